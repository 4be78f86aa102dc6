"""fp8 KV cache (quantized on write, dequantized inside the attention kernel) and sliding-window
masking: the Triton kernels (interpreted on CPU) against the torch reference."""
import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import paged_attention_reference, triton_available, write_kv_reference  # noqa: E402
from engine.kernels.reference import dequantize, quantize  # noqa: E402
from engine.kernels.testing import make_attention_inputs  # noqa: E402

if not triton_available():
    pytest.skip("Triton kernels cannot run here", allow_module_level=True)

from engine.kernels import paged_attention, write_kv  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_inputs(q_lens, seq_lens, dtype=torch.float32, fp8=E4M3, heads=(4, 2), head_dim=32, block_size=16):
    inputs = make_attention_inputs(q_lens, seq_lens, *heads, head_dim, block_size, dtype)
    kv_heads = heads[1]
    # per-head scales: KV of head h has a range about its scale, as calibrated scales would give
    inputs["k_scale"] = torch.tensor([0.5, 2.0, 1.0, 0.25][:kv_heads], dtype=torch.float32)
    inputs["v_scale"] = torch.tensor([1.5, 0.75, 1.0, 3.0][:kv_heads], dtype=torch.float32)
    for name, scale in (("k_cache", inputs["k_scale"]), ("v_cache", inputs["v_scale"])):
        values = inputs[name].float() * scale[:, None] * 4
        inputs[name] = quantize(values, scale, fp8)
    return inputs


def run_both(inputs, **kw):
    out = paged_attention(**inputs, **kw)
    ref_args = {k: v for k, v in inputs.items() if k not in ("max_query_len", "max_seq_len")}
    ref = paged_attention_reference(**ref_args, **{k: v for k, v in kw.items() if k == "sliding_window"})
    return out.float(), ref.float()


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cache_prefill_and_decode(fp8, dtype):
    inputs = fp8_inputs([1, 9, 1], [40, 30, 17], dtype, fp8)
    out, ref = run_both(inputs)
    torch.testing.assert_close(out, ref, **(dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32
                                             else dict(atol=5e-2, rtol=5e-2)))


def test_fp8_cache_split_kv():
    inputs = fp8_inputs([1, 1], [600, 70])
    out, ref = run_both(inputs, force_split=True)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


def test_scales_matter():
    """Reading the fp8 cache without its scales is wrong: the kernel does apply them."""
    inputs = fp8_inputs([1, 3], [40, 20])
    out, _ = run_both(inputs)
    inputs["k_scale"] = torch.ones(2)
    inputs["v_scale"] = torch.ones(2)
    unscaled, _ = run_both(inputs)
    assert (out - unscaled).abs().max() > 0.1


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_quantizes_like_the_reference(fp8, dtype):
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(7, 2, 32, generator=g) * 30).to(dtype)          # some beyond e4m3's 448 after scaling
    value = (torch.randn(7, 2, 32, generator=g) * 3).to(dtype)
    key[0, 0, :4] = torch.tensor([7.94, -7.94, 0.001, 1e-6])          # a carry into the exponent, subnormals
    k_scale, v_scale = torch.tensor([0.05, 1.0]), torch.tensor([1.0, 0.5])
    slots = torch.tensor([0, 5, -1, 17, 31, 2, 9])
    caches = [torch.zeros(4, 8, 2, 32, dtype=fp8) for _ in range(4)]
    write_kv(key, value, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale)
    write_kv_reference(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    back = dequantize(caches[0].flatten(0, 1)[slots[slots >= 0]], k_scale)
    limit = torch.finfo(fp8).max * k_scale[:, None]
    expected = key[slots >= 0].float().clamp(-limit, limit)
    assert ((back - expected).abs() <= expected.abs() * 0.13 + 1e-3).all()   # within fp8 precision


def test_fp8_requires_scales():
    inputs = fp8_inputs([1], [20])
    del inputs["k_scale"]
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(**inputs)
    with pytest.raises(ValueError, match="needs k_scale"):
        write_kv(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), torch.zeros(2, 4, 2, 32, dtype=E4M3),
                 torch.zeros(2, 4, 2, 32, dtype=E4M3), torch.tensor([0]))


@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_sliding_window_prefill_chunk_and_decode(window):
    inputs = make_attention_inputs([1, 12, 20, 1], [70, 45, 20, 9], 4, 2, 32, 16)
    out, ref = run_both(inputs, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


def test_sliding_window_split_kv_and_it_matters():
    inputs = make_attention_inputs([1, 1], [700, 90], 4, 2, 32, 16)
    out, ref = run_both(inputs, sliding_window=100, force_split=True)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    full, _ = run_both(inputs, force_split=True)
    assert (full - out).abs().max() > 1e-2                    # the window changes the answer


def test_sliding_window_with_fp8_bf16():
    inputs = fp8_inputs([1, 5], [60, 33], torch.bfloat16)
    out, ref = run_both(inputs, sliding_window=24)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_bad_window_is_refused():
    inputs = make_attention_inputs([1], [20], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(**inputs, sliding_window=0)


@pytest.mark.parametrize("prefetch,dtype,block_size,tile,split", [
    (True, torch.bfloat16, 16, 32, False),      # the default decode config: tiles span two blocks
    (True, torch.float32, 32, 16, True),        # a tile inside a block: one block-table load
    (True, torch.float32, 16, 16, False),       # a tile is a block
    (False, torch.float32, 32, 16, False),      # no prefetch, tile inside a block
], ids=["prefetch-spans-bf16", "prefetch-in-block-split", "prefetch-is-block", "single-in-block"])
def test_decode_tiles_prefetched_or_not(prefetch, dtype, block_size, tile, split):
    """The decode loop with the next tile's K/V loaded ahead (the default decode config) and
    without, with tiles spanning blocks or inside one (one block-table load per tile)."""
    from engine.kernels.paged_attention import AttentionConfig

    inputs = make_attention_inputs([1, 1, 1], [70, 33, 1], 4, 2, 32, block_size, dtype)
    config = AttentionConfig(block_m=16, tile_size=tile, prefetch=prefetch)
    out, ref = run_both(inputs, config=config, force_split=split)
    torch.testing.assert_close(out, ref, **(dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32
                                             else dict(atol=5e-2, rtol=5e-2)))
