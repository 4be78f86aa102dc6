"""Kernel launches per decode step: what the GPU would see, counted on CPU.

Every torch op that computes (aten ops through a dispatch hook, views excluded: they launch
nothing) and every Triton kernel launch, attributed to the decoder layer running at the time.
The Triton backend with fused elementwise kernels must stay within 12 launches per layer
(eager elementwise ops took ~45 per layer). Triton kernels run through the interpreter
here; what the interpreter itself does with torch while running one is not counted.
"""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from engine.kernels import triton_available  # noqa: E402

if not triton_available():
    pytest.skip("Triton kernels cannot run here", allow_module_level=True)

from engine.runner import ModelRunner  # noqa: E402
from engine.weights import build_model  # noqa: E402
from sim.core.catalog import get_model  # noqa: E402
from sim.core.kv import KVCacheManager  # noqa: E402
from validate.calibrate import probe_batch  # noqa: E402

MAX_PER_LAYER = 12
# Allocations launch nothing on a GPU (the caching allocator hands out memory).
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "detach"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = "outside"
        self.counts: dict[str, Counter] = {}
        self.paused = False

    def record(self, name: str) -> None:
        self.counts.setdefault(self.where, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in NO_LAUNCH:
            self.record(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture()
def counter(monkeypatch):
    from engine.kernels import fused, kv_write
    import engine.kernels.paged_attention  # noqa: F401
    import sys

    attention_module = sys.modules["engine.kernels.paged_attention"]
    kernel_type = type(fused._add_rms_norm_kernel)
    original = kernel_type.run
    mode = LaunchCounter()

    def counted_run(self, *args, **kwargs):
        mode.record("triton:" + self.fn.__name__ if hasattr(self, "fn") else "triton")
        mode.paused = True
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.paused = False

    monkeypatch.setattr(kernel_type, "run", counted_run)
    assert kv_write and attention_module
    return mode


def decode_step_counts(counter, backend: str, batch: int = 3, context: int = 40):
    model = build_model(get_model("tiny"), "cpu", attention_backend=backend)
    runner = ModelRunner(model, batch * 4 + 1, 16, 256)
    kv = KVCacheManager(runner.num_blocks, 16, enable_caching=False)
    step = probe_batch(kv, [(context, 1, True)] * batch, tag=0)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: setattr(counter, "where", f"layer{i}"))
        layer.register_forward_hook(lambda *_: setattr(counter, "where", "outside"))
    with counter:
        runner.execute(step)
    return counter.counts


def test_fused_triton_decode_step_stays_within_12_launches_per_layer(counter):
    counts = decode_step_counts(counter, "triton")
    layers = [c for where, c in counts.items() if where.startswith("layer")]
    assert len(layers) == 2
    for c in layers:
        total = sum(c.values())
        assert total <= MAX_PER_LAYER, c
        assert c["triton:_add_rms_norm_kernel"] == 2 and c["triton:_rotary_kernel"] == 1
        assert c["triton:_silu_mul_kernel"] == 1 and c["triton:_write_kv_kernel"] == 1
        assert c["linear"] == 4                         # qkv, o, gate_up, down: the GEMMs


def test_the_torch_path_launches_many_more(counter):
    """The reference path, for scale: what fusing saves."""
    counts = decode_step_counts(counter, "torch")
    per_layer = sum(counts["layer0"].values())
    assert per_layer > 2 * MAX_PER_LAYER, counts["layer0"]     # 48 on the tiny model (torch attention)
