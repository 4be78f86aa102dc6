"""Runs a scheduler Batch on the model: packs tensors, forwards, samples, appends live tokens.

The runner owns the KV pool, one tensor [layers, 2 (K, V), num_blocks, block_size,
kv_heads, head_dim]; each layer reads views of it. Block ids come from the same
KVCacheManager the simulator uses, so block 0 (the null block) is never written and pads
the block tables. A static batch's padding rows (HF generate's padded batch) read only the
null block and write nothing (slot -1), so they cannot touch a live request's K/V.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.model import CausalLM, Sampler, layer_window
from engine.weights import build_model
from sim.core.catalog import MIB
from sim.core.memory import InsufficientMemoryError, MemoryPlan, cdiv, plan_memory
from sim.core.scheduler import Batch


class InconsistentBatchError(RuntimeError):
    """The scheduler handed the runner a batch whose state cannot be executed."""


@dataclass
class StepResult:
    sampled: dict[int, int]          # request id -> sampled token, for requests that emitted one
    logits: torch.Tensor             # [len(sampled), vocab] fp32, rows in the order of `sampled`
    host_s: float                    # Python around the forward: tensor building, logits, sampling
    device_s: float                  # the forward: CUDA events on GPU, wall time on CPU
    rows: int = 0                    # sequences computed, a static batch's padding rows included
    tokens: int = 0                  # tokens computed, padding included


@dataclass
class PreparedStep:
    """A step's host side, ready to launch (ModelRunner.prepare)."""
    batch: Batch
    emit: list[int]                  # indices in batch.reqs of the sequences that sample a token
    host: dict[str, np.ndarray]      # host_step_arrays + input_ids + logit_rows (token rows of `emit`)
    graph: Optional[tuple]           # the CUDA graph key, or None: eager
    rows: int
    tokens: int
    host_s: float


@dataclass
class PendingStep:
    """A launched step (ModelRunner.launch): its device outputs and the host copy of its samples,
    valid once `ready` (a CUDA event; None on CPU, where the copy was synchronous) completed."""
    step: PreparedStep
    logits: torch.Tensor
    tokens: torch.Tensor
    ready: Optional[torch.cuda.Event]
    timer: "_DeviceTimer"
    host_s: float


def build_attn_metadata(block_lists: list[list[int]], starts: list[int], query_lens: list[int],
                        block_size: int, device: torch.device,
                        table_buffer: Optional["BlockTable"] = None,
                        written_tokens: Optional[int] = None) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and paged-attention metadata for sequences packed back to back.

    Sequence s computes tokens [starts[s], starts[s] + query_lens[s]) and reads its KV
    through block_lists[s] (only the blocks its context covers go into the table). Built with
    array operations, no per-sequence loop but the one that flattens the block lists. With a
    `table_buffer`, the block table lands in its persistent device buffer (fixed row stride).
    Tokens past the first `written_tokens` (padding) write no K/V: slot -1.
    """
    host = host_step_arrays(block_lists, starts, query_lens, block_size, written_tokens)
    return metadata_from_host(host, block_size, device, table_buffer)


def metadata_from_host(host: dict[str, np.ndarray], block_size: int, device: torch.device,
                       table_buffer: Optional["BlockTable"] = None) -> tuple[torch.Tensor, AttentionMetadata]:
    """host_step_arrays' arrays on the device: (positions, attention metadata)."""
    table = host["block_tables"]
    device_tables = table_buffer.update(table) if table_buffer is not None else _to(table, device)
    meta = AttentionMetadata(
        slot_mapping=_to(host["slot_mapping"], device), block_tables=device_tables,
        seq_lens=_to(host["seq_lens"], device), query_start_loc=_to(host["query_start_loc"], device),
        max_query_len=int(host["query_lens"].max()), max_seq_len=int(host["seq_lens"].max()),
        block_size=block_size, host_query_start_loc=host["query_start_loc"].tolist(),
        host_seq_lens=host["seq_lens"].tolist())
    return _to(host["positions"], device), meta


def host_step_arrays(block_lists: list[list[int]], starts: list[int], query_lens: list[int],
                     block_size: int, written_tokens: Optional[int] = None) -> dict[str, np.ndarray]:
    """The step's metadata as host arrays (what build_attn_metadata and the graphs copy in)."""
    starts_np, q_lens = np.asarray(starts, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
    seq_lens = starts_np + q_lens
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)])
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(query_start_loc[-1]) - query_start_loc[seq_of_token] + starts_np[seq_of_token]
    block_tables = pack_block_tables(block_lists, -(-seq_lens // block_size))
    slot_mapping = (block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    if written_tokens is not None:
        slot_mapping[written_tokens:] = -1
    return {"positions": positions, "slot_mapping": slot_mapping, "seq_lens": seq_lens.astype(np.int32),
            "query_start_loc": query_start_loc.astype(np.int32), "query_lens": q_lens,
            "block_tables": block_tables}


def pack_block_tables(block_lists: list[list[int]], num_blocks: np.ndarray) -> np.ndarray:
    """[seqs, max(num_blocks)] int32: row s holds block_lists[s][:num_blocks[s]], 0-padded."""
    counts = num_blocks.tolist()
    total = int(num_blocks.sum())
    flat = np.fromiter(chain.from_iterable(b[:n] for b, n in zip(block_lists, counts)), np.int32, total)
    rows = np.repeat(np.arange(len(counts)), num_blocks)
    cols = np.arange(total) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
    tables = np.zeros((len(counts), int(num_blocks.max(initial=0))), dtype=np.int32)
    tables[rows, cols] = flat
    return tables


class BlockTable:
    """The device block table, allocated once: [rows, max_model_len / block_size] int32.
    Each step copies its rows in (one host-to-device copy) and the kernels get a view of the
    first rows at full width, so the row stride never changes (no recompiles, graph-safe)."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, rows: int = 256):
        self.width, self.device = max_blocks_per_seq, device
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        self.device_table = torch.zeros(rows, self.width, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        # Two staging buffers taken in turn, each with the event of its last copy: with one
        # step in flight (overlapped steps), step N+1 stages its rows while step N's copy may
        # still be queued behind step N-1's work.
        self.staging = [torch.zeros(rows, self.width, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0

    def reserve(self, rows: int) -> None:
        """At least `rows` rows (a reallocation moves the table: captured graphs notice)."""
        if rows > self.device_table.shape[0]:
            self._alloc(max(rows, 2 * self.device_table.shape[0]))

    def update(self, tables: np.ndarray) -> torch.Tensor:
        seqs, width = tables.shape
        if width > self.width:
            raise InconsistentBatchError(f"a block table of {width} blocks exceeds max_model_len's {self.width}")
        self.reserve(seqs)
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:      # this buffer's previous copy (two steps back) is done
            self._copied[turn].synchronize()
        staged = self.staging[turn][:seqs]
        staged.numpy()[:, :width] = tables
        self.device_table[:seqs].copy_(staged, non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        return self.device_table[:seqs]


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def uniform_window(spec) -> Optional[int]:
    """The window every layer shares (Mistral v0.1), or None (full attention, or hybrid layers)."""
    windows = {layer_window(spec, i) for i in range(spec.num_layers)}
    return windows.pop() if len(windows) == 1 else None


def check_batch(batch: Batch, block_size: int, max_model_len: int, num_blocks: int,
                window: Optional[int] = None) -> None:
    """Refuse, loudly, a batch the scheduler should never have produced (an engine with these
    limits could not execute it). Array checks over the whole step; the per-sequence message
    is only worked out when one fails. With a `window` on every layer, the blocks behind the
    window of a sequence's first new token may be the null block (the shared policy freed them;
    the kernels never read them)."""
    reqs = batch.reqs
    if not reqs:
        raise InconsistentBatchError(f"step {batch.step}: empty batch")
    if len({r.id for r in reqs}) != len(reqs):
        raise InconsistentBatchError(f"step {batch.step}: a request appears twice")
    state = np.array([(r.num_computed, r.num_tokens, len(r.blocks)) for r in reqs], dtype=np.int64)
    computed, known, held = state.T
    new = np.asarray(batch.num_new, dtype=np.int64)
    needed = -(-computed // block_size)
    bad = (new < 1) | (computed < new) | (computed > known) | (computed > max_model_len) | (held < needed)
    if not bad.any():
        used = pack_block_tables([r.blocks for r in reqs], needed)
        cols = np.arange(used.shape[1])[None, :]
        in_use = (cols < needed[:, None]) & (cols >= _behind_window(computed - new, block_size, window)[:, None])
        bad = ((used < 1) | (used >= num_blocks)).any(axis=1, where=in_use)
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        problem = _sequence_problem(reqs[s], batch.num_new[s], block_size, max_model_len, num_blocks, window)
        raise InconsistentBatchError(f"step {batch.step}, request {reqs[s].id}: {problem}")


def _behind_window(starts, block_size: int, window: Optional[int]):
    """Leading blocks no query of the step can see (0 without a window): sliding_window_skipped_blocks."""
    if window is None:
        return np.zeros_like(starts)
    return np.maximum(starts - window + 1, 0) // block_size


def _sequence_problem(req, n: int, block_size: int, max_model_len: int, num_blocks: int,
                      window: Optional[int] = None) -> Optional[str]:
    seq_len = req.num_computed
    if n < 1 or seq_len - n < 0:
        return f"{n} new tokens with {seq_len} computed"
    if seq_len > req.num_tokens:
        return f"{seq_len} tokens computed but only {req.num_tokens} are known"
    if seq_len > max_model_len:
        return f"context {seq_len} exceeds max_model_len {max_model_len}"
    if len(req.blocks) < cdiv(seq_len, block_size):
        return f"{len(req.blocks)} blocks cannot hold {seq_len} tokens of block size {block_size}"
    used = req.blocks[int(_behind_window(np.int64(seq_len - n), block_size, window)):cdiv(seq_len, block_size)]
    if min(used) < 1 or max(used) >= num_blocks:
        return f"block ids {used} outside 1..{num_blocks - 1}"
    return None


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 max_model_len: Optional[int] = None, temperature: float = 0.0, seed: int = 0,
                 kv_cache_dtype: str = "auto"):
        spec = model.spec
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = min(max_model_len or model.max_positions, model.max_positions)
        self.window = uniform_window(spec)      # checked every step: worked out once
        self.vocab_size = spec.vocab_size
        dtype = kv_pool_dtype(kv_cache_dtype, model.dtype)
        self.kv_cache = torch.zeros(spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads,
                                    spec.head_dim, dtype=dtype, device=self.device)
        # fp8: per-layer, per-KV-head scales, 1.0 as vLLM uses when the checkpoint brings none
        self.kv_scales = (torch.ones(spec.num_layers, 2, spec.num_kv_heads, device=self.device)
                          if dtype != model.dtype else None)
        self.bind()
        self.block_table = BlockTable(cdiv(self.max_model_len, block_size), self.device)
        self.graphs = None                      # DecodeGraphs once capture_graphs ran (CUDA only)
        self.sampler = Sampler(temperature, seed, self.device)
        self._token_buffers: list[Optional[torch.Tensor]] = [None, None]
        self._token_turn = 0
        self.plan: Optional[MemoryPlan] = None

    @classmethod
    def from_scenario(cls, scenario, device: torch.device | str | None = None,
                      attention_backend: Optional[str] = None, temperature: float = 0.0) -> "ModelRunner":
        """Build the model, size the KV pool as vLLM does (profile, then plan) and allocate it."""
        model = build_model(scenario.model, device, attention_backend, scenario.seed,
                            max_positions=scenario.max_model_len)
        plan = profile_and_plan(scenario, model)
        runner = cls(model, plan.num_blocks, scenario.engine.block_size, scenario.max_model_len,
                     temperature, scenario.seed, getattr(scenario.engine, "kv_cache_dtype", "auto"))
        runner.plan = plan
        return runner

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        """One step, start to finish. device_s covers what the cost model calls device time:
        the forward, the LM head and sampling; host_s is the Python around it (inputs, outputs)."""
        return self.collect(self.launch(self.prepare(batch)))

    def prepare(self, batch: Batch) -> "PreparedStep":
        """The step's host side that needs no earlier step's sampled tokens: the batch check,
        input ids, positions, slot mapping, block table rows, the rows whose logits are computed.
        Overlapped steps (StepPipeline) run it while the previous step is on the device."""
        t0 = time.perf_counter()
        self.check_batch(batch)
        reqs, num_new = batch.reqs, batch.num_new
        starts = batch.starts()
        input_ids = [r.token_ids(s, s + n, self.vocab_size) for r, s, n in zip(reqs, starts, num_new)]
        # A sequence emits iff its chunk reaches the end of its known tokens (a decode, or a
        # prompt's last chunk): the row of its last new token predicts the next one.
        emit = [s for s, r in enumerate(reqs) if r.num_computed >= r.num_tokens]
        blocks = [r.blocks for r in reqs]
        pad_starts, pad_lens, pad_logits = self.static_padding(batch)
        live_tokens = sum(num_new)
        if pad_lens:
            null_table = [0] * cdiv(self.max_model_len, self.block_size)
            blocks += [null_table] * len(pad_lens)
            input_ids += [np.zeros(n, dtype=np.int64) for n in pad_lens]
            starts, num_new = starts + pad_starts, num_new + pad_lens
        host = host_step_arrays(blocks, starts, num_new, self.block_size, live_tokens)
        host["input_ids"] = np.concatenate(input_ids)
        # rows whose logits are computed: the emitting ones, then padding decode rows (HF
        # computes every row's logits); only the emitting ones are sampled
        logit_rows = emit + [len(reqs) + p for p in pad_logits]
        host["logit_rows"] = host["query_start_loc"][1:].astype(np.int64)[logit_rows] - 1
        graph = self._graph_for(batch, emit, len(num_new), int(host["seq_lens"].max()))
        return PreparedStep(batch, emit, host, graph, rows=len(reqs) + len(pad_logits),
                            tokens=sum(num_new), host_s=time.perf_counter() - t0)

    @torch.inference_mode()
    def launch(self, step: "PreparedStep") -> "PendingStep":
        """Queue the step's forward, logits and sampling on the device, then the copy of the
        sampled ids into a pinned host buffer and an event after it. Returns without waiting:
        on a GPU the device works while the host prepares the next step."""
        t0 = time.perf_counter()
        host, emit = step.host, step.emit
        num_seqs = len(host["seq_lens"])
        timer = _DeviceTimer(self.device)           # started once the inputs are copied in
        if step.graph is not None:
            self.block_table.update(host["block_tables"])
            timer.start()
            logits, sampled = self.graphs.run(step.graph, host, num_seqs)
            logits, sampled = logits[:len(emit)], sampled[:len(emit)]
        else:
            positions, meta = metadata_from_host(host, self.block_size, self.device, self.block_table)
            input_ids, rows = _to(host["input_ids"], self.device), _to(host["logit_rows"], self.device)
            timer.start()
            hidden = self.model(input_ids, positions, meta)
            logits = self.model.compute_logits(hidden[rows])[:len(emit)]
            sampled = self.sampler(logits) if emit else rows[:0]
        timer.stop()
        tokens = self._token_buffer(len(emit))
        tokens.copy_(sampled, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        # on CPU the forward ran inside launch: its time is the device's, not the host's
        launch_host = time.perf_counter() - t0 - (0.0 if timer.cuda else timer.wall)
        return PendingStep(step, logits, tokens, ready, timer, step.host_s + launch_host)

    def collect(self, pending: "PendingStep") -> StepResult:
        """Wait for the step's sampled ids on the host and hand them to live requests."""
        if pending.ready is not None:
            pending.ready.synchronize()                 # the device's time, not the host's
        t0 = time.perf_counter()
        step = pending.step
        tokens = pending.tokens.tolist()
        reqs = step.batch.reqs
        emitted = [reqs[s] for s in step.emit]
        for req, token in zip(emitted, tokens):
            output = req.segments[-1]
            if isinstance(output, list):                # live request: the sample is its output
                output.append(token)
                if token == req.eos_token_id:           # finish_step retires it at this length
                    req.cut_output(req.num_output + 1)
        device_s = pending.timer.seconds()
        host_s = pending.host_s + (time.perf_counter() - t0)
        return StepResult({r.id: t for r, t in zip(emitted, tokens)}, pending.logits, host_s, device_s,
                          rows=step.rows, tokens=step.tokens)

    def _token_buffer(self, n: int) -> torch.Tensor:
        """A host buffer for n sampled ids (pinned on CUDA), two taken in turn so that step N+1's
        copy never lands in the buffer step N's ids are still read from."""
        turn, self._token_turn = self._token_turn, 1 - self._token_turn
        buf = self._token_buffers[turn]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._token_buffers[turn] = buf
        return buf[:n]

    def static_padding(self, batch: Batch) -> tuple[list[int], list[int], list[int]]:
        """A static batch's padding as extra sequences on the null block: (starts, lengths,
        indices of the padding decode rows among them). None but on a static batch's steps.

        The forming step is HF generate's [B, P] prefill: each prompt computing n < P tokens
        gets a pad sequence of P - n tokens at positions n..P-1 (so the row attends as a
        P-token one does). Every later step adds one decode row per member no longer
        decoding, at the padded context; positions are capped at max_model_len."""
        if not batch.pad_len:
            return [], [], []
        if batch.admitted:
            pads = [(n, batch.pad_len - n) for n in batch.prefill_new if n < batch.pad_len]
            return [s for s, _ in pads], [n for _, n in pads], []
        ctx = min(batch.pad_len, self.max_model_len)
        return [ctx - 1] * batch.pad_rows, [1] * batch.pad_rows, list(range(batch.pad_rows))

    def check_batch(self, batch: Batch) -> None:
        check_batch(batch, self.block_size, self.max_model_len, self.num_blocks, self.window)

    def bind(self) -> None:
        """Point the model's layers at this runner's pool (runners sharing a model take turns)."""
        self.model.bind_kv_cache(self.kv_cache, self.kv_scales)

    # -- CUDA graphs ---------------------------------------------------------------------
    def capture_graphs(self, max_num_seqs: int) -> int:
        """Capture the decode graphs (CUDA, Triton backend, greedy only); the number captured.
        A capture that fails leaves the runner eager, loudly."""
        from engine.cuda_graphs import DecodeGraphs, graphs_wanted

        if not graphs_wanted(self.device, self.model.attention_backend, self.sampler.temperature):
            return 0
        try:
            with torch.inference_mode():        # as execute() runs: the buffers and outputs alike
                graphs = DecodeGraphs(self, max_num_seqs)
                count = graphs.capture_all()
        except RuntimeError as e:       # e.g. an op that cannot be captured: stay eager, say so
            warnings.warn(f"CUDA graph capture failed, decode steps run eagerly: {e}")
            self.graphs = None
            return 0
        self.graphs = graphs
        return count

    def _graph_for(self, batch: Batch, emit: list[int], num_seqs: Optional[int] = None,
                   max_seq_len: Optional[int] = None):
        """The graph key for a decode-only step whose every live sequence emits, else None.
        `num_seqs` and `max_seq_len` count a static batch's padding decode rows, which ride
        along in the graph (default: the live sequences alone)."""
        if (self.graphs is None or len(emit) != len(batch.reqs) or max(batch.num_new) != 1
                or (batch.admitted and batch.pad_len)):
            return None
        return self.graphs.key(num_seqs or len(batch.reqs),
                               max_seq_len or max(r.num_computed for r in batch.reqs))

    # -- memory --------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held: on GPU the allocator's peak, on CPU weights + KV pool (no allocator stats)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        pool = self.kv_cache.numel() * self.kv_cache.element_size()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = weights + pool
        return {"weight_bytes": weights, "kv_pool_bytes": pool, "num_blocks": self.num_blocks,
                "peak_bytes": peak}


KV_POOL_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a scenario's kv_cache_dtype (vLLM's names)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_POOL_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, {', '.join(KV_POOL_DTYPES)}")
    return KV_POOL_DTYPES[kv_cache_dtype]


class _DeviceTimer:
    """Times a step on the device: CUDA events (read once the step is done) on GPU, wall
    time on CPU, where the forward runs synchronously between start() and stop()."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wall = 0.0

    def start(self) -> "_DeviceTimer":
        self._t0 = time.perf_counter()
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        return self

    def stop(self) -> None:
        self.wall = time.perf_counter() - self._t0
        if self.cuda:
            self._end.record()

    def seconds(self) -> float:
        if not self.cuda:
            return self.wall
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1e3


# -- KV pool sizing ------------------------------------------------------------------------

def profile_and_plan(scenario, model: CausalLM) -> MemoryPlan:
    """vLLM's sizing: a profiling forward measures the activation peak, sim.core.memory does the rest.

    Measured on CUDA only: CPU has no allocator stats, so sim.core.memory's estimate stands there.
    An explicit engine.num_blocks or engine.activation_mib also skips the measurement.
    """
    eng = scenario.engine
    if model.device.type != "cuda" or eng.num_blocks is not None or eng.activation_mib is not None:
        return plan_memory(scenario)
    torch.cuda.empty_cache()    # memory cached from an earlier pool counts as used in mem_get_info
    activation = profile_run(model, scenario.max_num_batched_tokens, scenario.max_num_seqs)
    measured = scenario.model_copy(deep=True)
    measured.engine.activation_mib = activation / MIB
    plan = plan_memory(measured)
    free, _ = torch.cuda.mem_get_info(model.device)
    if plan.kv_pool_bytes > free:
        raise InsufficientMemoryError(
            f"the planned KV pool ({plan.kv_pool_bytes / MIB:,.1f} MiB, {plan.num_blocks} blocks) exceeds "
            f"the {free / MIB:,.1f} MiB free on {model.device}; lower engine.gpu_memory_utilization "
            f"or set engine.num_blocks")
    return plan


@torch.inference_mode()
def profile_run(model: CausalLM, num_tokens: int, max_num_seqs: int) -> Optional[int]:
    """One dummy forward of `num_tokens` tokens over min(num_tokens, max_num_seqs) sequences,
    then logits and sampling for one row each; returns the CUDA activation peak in bytes.

    The forward runs without a KV cache, as vLLM's does, so no pool is needed yet.
    """
    query_lens = profile_query_lens(num_tokens, max_num_seqs)
    device = model.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    meta = AttentionMetadata.dense(query_lens, device)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(input_ids, positions, meta)
    last_rows = meta.query_start_loc[1:].long() - 1
    Sampler(temperature=1.0, device=device)(model.compute_logits(hidden[last_rows]))
    if not cuda:
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def profile_query_lens(num_tokens: int, max_num_seqs: int) -> list[int]:
    """vLLM's dummy batch: the tokens split evenly over the sequences, the remainder to the last."""
    num_seqs = min(num_tokens, max_num_seqs)
    query_lens = [num_tokens // num_seqs] * num_seqs
    query_lens[-1] += num_tokens % num_seqs
    return query_lens
