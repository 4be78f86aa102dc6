"""Fused RMSNorm / rotary / SiLU-mul kernels (interpreted on CPU) against the model's torch ops."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.kernels import triton_available  # noqa: E402

if not triton_available():
    pytest.skip("Triton kernels cannot run here", allow_module_level=True)

from engine.kernels.fused import add_rms_norm, rotary, silu_mul  # noqa: E402
from engine.model import RMSNorm, _rotate  # noqa: E402

# fp32: same arithmetic, reordered reductions; 16-bit: one rounding of the output
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    residual = torch.randn(5, 96, generator=g).to(dtype)
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    expected_sum = (x + residual) if with_residual else x
    expected = norm(expected_sum)
    res = residual.clone() if with_residual else None
    out = add_rms_norm(x, norm.weight, 1e-6, res)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    if with_residual:
        # the residual stream, updated in place (the interpreter truncates fp32 -> bf16, torch rounds)
        torch.testing.assert_close(res, expected_sum, **(TOL[dtype] if dtype == torch.bfloat16 else dict(atol=0, rtol=0)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_qkv_views(dtype):
    g = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, d = 6, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(d // 2, generator=g))
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([0, 5, 63, 7, 7, 1])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, c, s), _rotate(k, c, s)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    rotary(positions, q, k, cos, sin)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)     # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(7, 2 * 80, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(torch.zeros(8, 4).t())
