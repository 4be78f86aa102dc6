"""LoRA adapters as vLLM V1 serves them (--enable-lora): the per-step adapter limit and the adapter
caches. No clock here, only steps and counts; sim/lora.py turns loads into seconds and prices the
kernels, docs/whatif/lora.md describes both.

- The step limit (vllm/v1/core/sched/scheduler.py `schedule`, main @00024d31, the same rule in 0.11-0.19):
  after the RUNNING pass, `scheduled_loras` is the set of adapters of the running requests it
  scheduled (a request with no adapter counts for none). A WAITING request with an adapter not in
  that set, while the set already holds `max_loras`, is skipped: taken out of the queue for the rest
  of the pass and put back at its head afterwards, in its order (`skipped_waiting_requests`,
  `prepend_requests`), so later requests may still be scheduled. An admitted request adds its
  adapter to the set. The RUNNING pass itself is not gated (vLLM asserts it never has to be).
- The caches (vllm/lora/worker_manager.py `LRUCacheWorkerLoRAManager.add_adapter`,
  vllm/lora/model_manager.py `LRUCacheLoRAModelManager`): before each forward the worker walks
  the step's adapters in batch order; one not among the `max_cpu_loras` adapters held in CPU
  memory is read from disk (evicting the least recently used one, which also leaves its GPU slot);
  one not among the `max_loras` GPU slots is copied into one (evicting the least recently used
  slot). Every adapter the step uses is touched in both caches.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

# The projections vLLM wraps with LoRA layers in each decoder layer (a dense model's).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_layer_groups(model, tp: int = 1) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """vLLM's LoRA-wrapped linear layers of one decoder layer on one rank: (layer, [(module, A's
    inputs, B's outputs) per slice]), with tensor parallelism's sharding (sim/lora.py's docstring)."""
    d, h = model.head_dim, model.hidden_size
    q, kv = model.num_heads * d, max(1, model.num_kv_heads // tp) * d   # (KV heads replicate past tp)
    inter = model.intermediate_size
    return [
        ("qkv_proj", [("q_proj", h, q // tp), ("k_proj", h, kv), ("v_proj", h, kv)]),
        ("o_proj", [("o_proj", q // tp, h)]),
        ("gate_up_proj", [("gate_proj", h, inter // tp), ("up_proj", h, inter // tp)]),
        ("down_proj", [("down_proj", inter // tp, h)]),
    ]


def adapter_bytes(model, rank: int, modules, tp: int = 1) -> int:
    """Bytes of one adapter's A and B matrices over every layer, in the model's dtype (lora_dtype
    auto), on one rank (tp 1: the whole adapter)."""
    per_layer = sum(i + o for _, slices in lora_layer_groups(model, tp) for name, i, o in slices if name in modules)
    return rank * per_layer * model.num_layers * model.dtype_bytes


def reserved_bytes(model, max_loras: int, max_lora_rank: int, tp: int = 1) -> int:
    """The stacked LoRA buffers vLLM allocates on each GPU: max_loras x max_lora_rank A and B
    for every wrapped projection of every layer."""
    return max_loras * adapter_bytes(model, max_lora_rank, TARGET_MODULES, tp)


@dataclass(frozen=True)
class LoraStep:
    """One step's adapter figures, for the cost model: tokens computed for requests with an
    adapter, the distinct adapters, and the adapters copied into GPU slots this step (from CPU
    memory, or read from disk first)."""

    tokens: int
    adapters: int
    from_cpu: tuple = ()
    from_disk: tuple = ()


@dataclass
class LoraStats:
    """summary.json's `lora` figures of one replica."""

    steps: int = 0                   # steps that computed anything
    adapter_steps: int = 0           # sum over steps of the distinct adapters in them
    max_adapters: int = 0            # the most distinct adapters one step held
    loads_from_cpu: int = 0          # GPU slot fills from the CPU cache
    loads_from_disk: int = 0         # ... read from disk first (not in the CPU cache)
    limited_steps: int = 0           # steps whose waiting pass skipped a request for max_loras
    skips: int = 0                   # waiting requests skipped for max_loras, counted per pass
    skipped: set = field(default_factory=set)    # request ids ever skipped
    cpu_loads: Counter = field(default_factory=Counter)     # adapter -> slot fills from CPU memory
    disk_loads: Counter = field(default_factory=Counter)    # adapter -> ... read from disk first

    def add(self, other: "LoraStats") -> None:
        self.steps += other.steps
        self.adapter_steps += other.adapter_steps
        self.max_adapters = max(self.max_adapters, other.max_adapters)
        self.loads_from_cpu += other.loads_from_cpu
        self.loads_from_disk += other.loads_from_disk
        self.limited_steps += other.limited_steps
        self.skips += other.skips
        self.skipped |= other.skipped
        self.cpu_loads.update(other.cpu_loads)
        self.disk_loads.update(other.disk_loads)

    def summary(self) -> dict:
        return {"loads_from_cpu": self.loads_from_cpu, "loads_from_disk": self.loads_from_disk,
                "steps_limited_by_max_loras": self.limited_steps, "skips_for_max_loras": self.skips,
                "requests_skipped_for_max_loras": len(self.skipped),
                "mean_adapters_per_step": self.adapter_steps / self.steps if self.steps else 0.0,
                "max_adapters_per_step": self.max_adapters}


class LoraSlots:
    """One replica's adapters: the GPU slots, the CPU cache and the step limit's bookkeeping."""

    def __init__(self, max_loras: int, max_cpu_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras {max_loras}: at least 1 expected")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}), as vLLM's "
                             f"LoRAConfig requires")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.gpu: OrderedDict = OrderedDict()     # adapter id -> None, least recently used first
        self.cpu: OrderedDict = OrderedDict()
        self.stats = LoraStats()

    @staticmethod
    def scheduled(batch) -> set:
        """The adapters of the requests a step has scheduled so far (vLLM's scheduled_loras)."""
        return {r.lora_id for r in batch.decodes if r.lora_id} | {r.lora_id for r in batch.prefills if r.lora_id}

    def must_skip(self, req, scheduled: set) -> bool:
        """Would admitting `req` exceed max_loras distinct adapters in the step?"""
        return bool(req.lora_id) and len(scheduled) >= self.max_loras and req.lora_id not in scheduled

    def skipped(self, reqs: list) -> None:
        """The waiting pass skipped these requests for max_loras."""
        if reqs:
            self.stats.limited_steps += 1
            self.stats.skips += len(reqs)
            self.stats.skipped.update(r.id for r in reqs)

    def activate(self, batch) -> LoraStep:
        """The step's adapters made resident (the caches' LRU rules, module docstring); returns
        what the cost model prices."""
        order: dict = {}
        tokens = 0
        num_new = batch.num_new
        for req, n in zip(batch.reqs, num_new):
            a = req.lora_id
            if a:
                order[a] = None
                tokens += n
        if len(order) > self.max_loras:
            raise AssertionError(f"a step holds {len(order)} adapters, more than max_loras {self.max_loras}")
        from_cpu, from_disk = [], []
        gpu, cpu = self.gpu, self.cpu
        for a in order:
            if a in cpu:
                cpu.move_to_end(a)
                on_disk = False
            else:
                if len(cpu) >= self.max_cpu_loras:
                    old, _ = cpu.popitem(last=False)
                    gpu.pop(old, None)          # leaving the CPU cache deactivates it
                cpu[a] = None
                on_disk = True
            if a in gpu:
                gpu.move_to_end(a)
                continue
            if len(gpu) >= self.max_loras:
                gpu.popitem(last=False)
            gpu[a] = None
            (from_disk if on_disk else from_cpu).append(a)
        stats = self.stats
        stats.steps += 1
        stats.adapter_steps += len(order)
        stats.max_adapters = max(stats.max_adapters, len(order))
        stats.loads_from_cpu += len(from_cpu)
        stats.loads_from_disk += len(from_disk)
        if from_cpu:
            stats.cpu_loads.update(from_cpu)
        if from_disk:
            stats.disk_loads.update(from_disk)
        return LoraStep(tokens, len(order), tuple(from_cpu), tuple(from_disk))


def lora_meta(schedulers, pricer=None) -> dict:
    """{"lora": the adapter figures over the replicas} for a run's records, or {} without LoRA.
    `pricer` (the cost model's LoRA part, sim/lora.py LoraCost) adds the seconds the loads took."""
    slots = [s.lora for s in schedulers if s.lora is not None]
    if not slots:
        return {}
    total = LoraStats()
    for s in slots:
        total.add(s.stats)
    figures = {"max_loras": slots[0].max_loras, "max_cpu_loras": slots[0].max_cpu_loras, **total.summary()}
    if pricer is not None:
        figures["load_s"] = pricer.loads_s(total.cpu_loads, total.disk_loads)
    return {"lora": figures}


class LoraScheduling:
    """The scheduler's part (a mixin `make_scheduler` puts in front of the reference
    Scheduler): the waiting pass skips a head whose adapter would exceed max_loras distinct
    adapters in the step (vLLM's scheduled_loras and skipped_waiting_requests), and a step's
    adapters are made resident. Every step's adapters are counted one request at a time, so the
    decode cohort is off."""

    __slots__ = ()
    state = ("_pass_loras", "_skipped")

    def __init__(self, config, kv, offload=None):
        super().__init__(config, kv, offload)
        self.lora = LoraSlots(*config.lora)
        self.lazy = False
        self._pass_loras: set = set()
        self._skipped: list = []       # (queue entry, request) skipped in this pass

    def _schedule_waiting(self, batch, budget: int) -> int:
        self._pass_loras = self.lora.scheduled(batch)      # the running pass's adapters
        self._skipped = []
        budget = super()._schedule_waiting(batch, budget)
        if self._skipped:              # back at the head, in their order (vLLM's prepend_requests)
            self.waiting.unskip([entry for entry, _ in self._skipped])
            self.lora.skipped([req for _, req in self._skipped])
        return budget

    def _skip_head(self, req) -> bool:
        if not self.lora.must_skip(req, self._pass_loras):
            return False
        self._skipped.append((self.waiting.skip_head(), req))     # later requests may go
        return True

    def _admit(self, req, admission, batch):
        scheduled = super()._admit(req, admission, batch)
        if scheduled is not None and req.lora_id:
            self._pass_loras.add(req.lora_id)
        return scheduled

    def _schedule_pass(self):
        batch = super()._schedule_pass()
        if batch is not None:
            batch.lora = self.lora.activate(batch)         # (loads priced by the cost model)
        return batch
