"""Compile every Triton kernel ahead of time for an NVIDIA GPU, without a GPU.

    python -m engine.kernels.aot [--arch 90] [--json]

Each wrapper is run on small CPU tensors with its kernel swapped for a recorder, so the
compiled signature, constexprs and launch options are exactly those the wrapper launches
with; then triton.compile lowers the real kernel to PTX and cubin with Triton's bundled
ptxas. This proves the source is valid compiled Triton, not only interpretable. Run it
with TRITON_INTERPRET unset or 0: the kernels are decorated when engine.kernels is imported.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from contextlib import contextmanager

class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextmanager
def _recording(module, attr):
    recorder = _Recorder(getattr(module, attr))
    setattr(module, attr, recorder)
    try:
        yield recorder
    finally:
        setattr(module, attr, recorder.kernel)


def launch_spec(kernel, target, args, kwargs):
    """(signature, constexprs, attrs, options) exactly as `kernel[grid](*args, **kwargs)` would
    compile them on `target`: Triton's own launch binder maps the arguments onto the parameters
    (a mismatch raises TypeError) and applies the runtime specialisations (ints equal to 1
    become constants, 16-divisible ints and pointers get alignment hints)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options.__dict__


def _attention_cases():
    """(label, make_attention_inputs kwargs, force_split): both paths (and the split path's
    reduce) for each dtype and head_dim 64/128 at GQA group 4, plus Qwen2.5-0.5B's group 7."""
    import torch
    cases = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            for label, q_lens, split in (("prefill", [24, 8], False), ("decode", [1, 1], False),
                                         ("split", [1, 1], True)):
                cases.append((f"{label}/{str(dtype)[6:]}/d{head_dim}",
                              dict(q_lens=q_lens, seq_lens=[40, 40], num_heads=32, num_kv_heads=8,
                                   head_dim=head_dim, block_size=16, dtype=dtype), split))
    for label, q_lens in (("prefill", [24, 8]), ("decode", [1, 1])):
        cases.append((f"{label}/bfloat16/d64/group7",
                      dict(q_lens=q_lens, seq_lens=[40, 40], num_heads=14, num_kv_heads=2,
                           head_dim=64, block_size=16, dtype=torch.bfloat16), False))
    return cases


def recorded_launches():
    """[(label, kernel, args, kwargs)] for every kernel launch the wrappers make in the cases."""
    import torch

    from .testing import make_attention_inputs
    kv_write = importlib.import_module(".kv_write", __package__)
    paged_attention = importlib.import_module(".paged_attention", __package__)  # the package attr is the function
    launches = []
    for label, spec, split in _attention_cases():
        inputs = make_attention_inputs(**spec)
        with _recording(paged_attention, "_attention_kernel") as main, \
                _recording(paged_attention, "_reduce_segments_kernel") as reduce:
            paged_attention.paged_attention(**inputs, force_split=split)
        launches += [(label, main.kernel, *call) for call in main.calls]
        launches += [(label + "/reduce", reduce.kernel, *call) for call in reduce.calls]
    launches += _fp8_and_window_launches()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        kv = torch.zeros(4, 16, 8, 128, dtype=dtype)
        key = torch.zeros(3, 8, 128, dtype=dtype)
        with _recording(kv_write, "_write_kv_kernel") as rec:
            kv_write.write_kv(key, key, kv, kv.clone(), torch.tensor([0, -1, 5]))
        launches += [(f"write_kv/{str(dtype)[6:]}", rec.kernel, *call) for call in rec.calls]
    launches += _fused_launches()
    return launches


def _fp8_and_window_launches():
    """bf16 queries over an fp8 (e4m3) cache, decode and prefill, split or not; a sliding
    window; and the fp8-quantizing KV write."""
    import torch

    from .testing import make_attention_inputs
    kv_write = importlib.import_module(".kv_write", __package__)
    paged_attention = importlib.import_module(".paged_attention", __package__)
    launches = []
    scales = dict(k_scale=torch.ones(8), v_scale=torch.ones(8))
    for label, q_lens, extra in (("fp8/decode", [1, 1], dict(force_split=False, **scales)),
                                 ("fp8/split", [1, 1], dict(force_split=True, **scales)),
                                 ("fp8/prefill", [24, 8], scales),
                                 ("window/prefill", [24, 8], dict(sliding_window=4096)),
                                 ("window/decode", [1, 1], dict(sliding_window=4096, force_split=True))):
        inputs = make_attention_inputs(q_lens, [40, 40], 32, 8, 128, 16, torch.bfloat16)
        if label.startswith("fp8"):
            inputs["k_cache"] = inputs["k_cache"].to(torch.float8_e4m3fn)
            inputs["v_cache"] = inputs["v_cache"].to(torch.float8_e4m3fn)
        with _recording(paged_attention, "_attention_kernel") as main, \
                _recording(paged_attention, "_reduce_segments_kernel"):
            paged_attention.paged_attention(**inputs, **extra)
        launches += [(label, main.kernel, *call) for call in main.calls]
    kv = torch.zeros(4, 16, 8, 128, dtype=torch.float8_e4m3fn)
    key = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    with _recording(kv_write, "_write_kv_kernel") as rec:
        kv_write.write_kv(key, key, kv, kv.clone(), torch.tensor([0, -1, 5]), **scales)
    launches += [("write_kv/fp8", rec.kernel, *call) for call in rec.calls]
    return launches


def _fused_launches():
    """The fused elementwise kernels at Qwen2.5-0.5B's shapes (hidden 896, 14/2 heads of 64,
    intermediate 4864), each dtype; q and k as views of the qkv projection, as the model has them."""
    import torch

    fused = importlib.import_module(".fused", __package__)
    launches = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        name = str(dtype)[6:]
        x = torch.zeros(3, 896, dtype=dtype)
        qkv = torch.zeros(3, (14 + 4) * 64, dtype=dtype)
        q, k = qkv[:, :896].view(3, 14, 64), qkv[:, 896:1024].view(3, 2, 64)
        table = torch.zeros(16, 32)
        calls = {"_add_rms_norm_kernel": lambda: fused.add_rms_norm(x, x[0], 1e-6, x.clone()),
                 "_rotary_kernel": lambda: fused.rotary(torch.zeros(3, dtype=torch.long), q, k, table, table),
                 "_silu_mul_kernel": lambda: fused.silu_mul(torch.zeros(3, 2 * 4864, dtype=dtype))}
        for attr, call in calls.items():
            with _recording(fused, attr) as rec:
                call()
            launches += [(f"fused{attr[:-7]}/{name}", rec.kernel, *c) for c in rec.calls]
    return launches


def compile_all(arch: int = 90, shard: int = 0, num_shards: int = 1) -> list[dict]:
    """Compile every recorded launch (those with index % num_shards == shard) for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", arch, 32)
    results = []
    for label, kernel, args, kwargs in recorded_launches()[shard::num_shards]:
        t0 = time.perf_counter()
        signature, constexprs, attrs, options = launch_spec(kernel, target, args, kwargs)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options)
        ptx = compiled.asm["ptx"]
        results.append(dict(
            label=label, kernel=kernel.__name__, ptx_bytes=len(ptx), cubin_bytes=len(compiled.asm["cubin"]),
            mma="wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
            shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
            seconds=round(time.perf_counter() - t0, 2)))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--shard", default="0/1", help="I/N: compile only every N-th launch from the I-th")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = ap.parse_args(argv)
    shard, num_shards = map(int, args.shard.split("/"))
    if importlib.import_module(".paged_attention", __package__).INTERPRET:
        ap.error("the kernels were decorated for the interpreter: run with TRITON_INTERPRET=0")
    results = compile_all(args.arch, shard, num_shards)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(f"{r['label']:<28} {r['kernel']:<26} cubin {r['cubin_bytes']:>7} B  {r['mma']:<8} "
                  f"shared {r['shared']:>6} B  {r['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
