"""Every Triton kernel compiles ahead of time to PTX + cubin for an H100/H200 (sm_90), no GPU
needed. Catches code that only the interpreter accepts. Runs `python -m engine.kernels.aot`
in subprocesses with TRITON_INTERPRET=0, since this pytest process decorated the kernels for
the interpreter. Uncached it takes ~25 s of CPU, split over two processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 2


@pytest.fixture(scope="module")
def compiled():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    procs = [subprocess.Popen([sys.executable, "-m", "engine.kernels.aot", "--json", f"--shard={i}/{SHARDS}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(SHARDS)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results += json.loads(out)
    return {r["label"]: r for r in results}


def test_every_kernel_builds_a_cubin(compiled):
    for dtype in ("float16", "bfloat16", "float32"):
        assert compiled[f"write_kv/{dtype}"]["cubin_bytes"] > 0
        for d in (64, 128):
            for path in ("prefill", "decode", "split"):
                assert compiled[f"{path}/{dtype}/d{d}"]["cubin_bytes"] > 0
            assert compiled[f"split/{dtype}/d{d}/reduce"]["kernel"] == "_reduce_segments_kernel"
    assert compiled["decode/bfloat16/d64/group7"]["cubin_bytes"] > 0
    for label in ("fp8/decode", "fp8/split", "fp8/prefill", "window/prefill", "window/decode", "write_kv/fp8"):
        assert compiled[label]["cubin_bytes"] > 0
    for dtype in ("float16", "bfloat16", "float32"):
        for kernel in ("_add_rms_norm", "_rotary", "_silu_mul"):
            assert compiled[f"fused{kernel}/{dtype}"]["cubin_bytes"] > 0
    assert all(r["ptx_bytes"] > 0 for r in compiled.values())


def test_16bit_attention_uses_tensor_cores(compiled):
    for label, r in compiled.items():
        if r["kernel"] == "_attention_kernel" and "float32" not in label:
            want = "wgmma" if label.split("/")[-1] == "prefill" or label.startswith("prefill") else "mma.sync"
            # (wgmma needs >= 64 rows: prefill tiles)
            assert r["mma"] == want, (label, r["mma"])


def test_shared_memory_fits_an_h100(compiled):
    assert max(r["shared"] for r in compiled.values()) <= 227 * 1024
