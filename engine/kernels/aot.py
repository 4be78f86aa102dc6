"""Compile every Triton kernel ahead of time for an NVIDIA GPU, without a GPU.

    python -m engine.kernels.aot [--arch 90] [--json]

Each wrapper is run on small CPU tensors with its kernel swapped for a recorder, so the
compiled signature, constexprs and launch options are exactly those the wrapper launches
with; then triton.compile lowers the real kernel to PTX and cubin with Triton's bundled
ptxas. This proves the source is valid compiled Triton, not only interpretable. It must
run in a process where TRITON_INTERPRET is off when the kernels are decorated: `main`
sets it before importing them, so run it as its own process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

_TYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


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


def _arg_type(value) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        return "*" + _TYPE_NAMES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {value!r}")


def signature_of(kernel, args, kwargs):
    """Map a recorded launch onto the kernel's parameters the way the launcher does:
    positional values fill the non-constexpr parameters, keywords the constexprs."""
    params = kernel.params
    runtime = [p.name for p in params if not p.is_constexpr]
    consts = [p.name for p in params if p.is_constexpr]
    if len(args) != len(runtime):
        raise TypeError(f"{kernel.__name__}: {len(args)} positional args for {len(runtime)} runtime parameters")
    given = {k for k in kwargs if k not in _LAUNCH_OPTIONS}
    if given != set(consts):
        raise TypeError(f"{kernel.__name__}: keyword args {sorted(given)} != constexprs {sorted(consts)}")
    signature = {name: _arg_type(v) for name, v in zip(runtime, args)}
    signature.update({name: "constexpr" for name in consts})
    signature = {p.name: signature[p.name] for p in params}          # parameter order
    constexprs = {name: kwargs[name] for name in consts}
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
    return signature, constexprs, options


def _attention_cases():
    """(label, kwargs for make_attention_inputs, paged_attention kwargs) covering both paths."""
    import torch
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            for label, q_lens, split in (("prefill", [24, 8], False), ("decode", [1, 1], False),
                                         ("split", [1, 1], True)):
                yield (f"{label}/{str(dtype)[6:]}/d{head_dim}",
                       dict(q_lens=q_lens, seq_lens=[40, 40], num_heads=32, num_kv_heads=8,
                            head_dim=head_dim, block_size=16, dtype=dtype), split)


def recorded_launches():
    """[(label, kernel, args, kwargs)] for every kernel launch the wrappers make in the cases."""
    import torch
    from . import kv_write, paged_attention
    from .testing import make_attention_inputs
    launches = []
    for label, spec, split in _attention_cases():
        inputs = make_attention_inputs(**spec)
        with _recording(paged_attention, "_attention_kernel") as main, \
                _recording(paged_attention, "_reduce_segments_kernel") as reduce:
            paged_attention.paged_attention(**inputs, force_split=split)
        launches += [(label, main.kernel, *call) for call in main.calls]
        launches += [(label + "/reduce", reduce.kernel, *call) for call in reduce.calls]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        kv = torch.zeros(4, 16, 8, 128, dtype=dtype)
        key = torch.zeros(3, 8, 128, dtype=dtype)
        with _recording(kv_write, "_write_kv_kernel") as rec:
            kv_write.write_kv(key, key, kv, kv.clone(), torch.tensor([0, -1, 5]))
        launches += [(f"write_kv/{str(dtype)[6:]}", rec.kernel, *call) for call in rec.calls]
    return launches


def compile_all(arch: int = 90) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", arch, 32)
    results = []
    for label, kernel, args, kwargs in recorded_launches():
        t0 = time.perf_counter()
        signature, constexprs, options = signature_of(kernel, args, kwargs)
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=target, options=options)
        ptx = compiled.asm["ptx"]
        results.append(dict(
            label=label, kernel=kernel.__name__, ptx_bytes=len(ptx), cubin_bytes=len(compiled.asm["cubin"]),
            mma="wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
            shared=compiled.metadata.shared, seconds=round(time.perf_counter() - t0, 2), **options))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = ap.parse_args(argv)
    if any(f"{__package__}.{m}" in sys.modules for m in ("paged_attention", "kv_write")):
        raise RuntimeError("kernels already decorated in this process; run engine.kernels.aot in a fresh one")
    os.environ["TRITON_INTERPRET"] = "0"
    results = compile_all(args.arch)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(f"{r['label']:<28} {r['kernel']:<26} cubin {r['cubin_bytes']:>7} B  {r['mma']:<8} "
                  f"shared {r['shared']:>6} B  {r['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
