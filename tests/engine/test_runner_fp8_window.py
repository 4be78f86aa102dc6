"""The engine with an fp8 KV pool and with sliding-window layers: the torch backend and the
Triton kernels (interpreted) agree, and both agree with what the options mean."""
import pytest
import torch

from engine.attention import AttentionMetadata, LayerKV
from engine.runner import ModelRunner, kv_pool_dtype
from engine.weights import build_model, init_random_weights
from sim.core.catalog import get_model
from sim.core.kv import KVCacheManager
from validate.calibrate import probe_batch

SEQS = [(40, 1, True), (23, 1, True), (0, 19, False), (16, 9, False)]


@pytest.fixture(scope="module")
def model():
    m = build_model(get_model("tiny"), "cpu")
    init_random_weights(m, seed=4, std=0.1)
    return m


def step_logits(model, backend, kv_cache_dtype="auto", window=None, seqs=SEQS, pool=None):
    model.attention_backend = backend
    runner = ModelRunner(model, 24, 16, 128, kv_cache_dtype=kv_cache_dtype)
    if window is not None:
        for layer in model.model.layers:
            layer.self_attn.kv = LayerKV(layer.self_attn.kv.k_scale, layer.self_attn.kv.v_scale, window)
    if pool is not None:
        runner.kv_cache.copy_(pool.to(runner.kv_cache.dtype))
    kv = KVCacheManager(runner.num_blocks, 16, enable_caching=False)
    try:
        return runner.execute(probe_batch(kv, seqs, tag=0)).logits
    finally:
        model.attention_backend = "torch"
        runner.kv_scales = None
        runner.bind()                                  # windows and scales back to the model's own


def random_pool(seed=0):
    shape = (2, 2, 24, 16, 2, 32)          # the tiny model's pool of 24 blocks
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_kv_pool_dtypes():
    assert kv_pool_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_pool_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_pool_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_pool_dtype("int4", torch.float16)


def test_fp8_pool_torch_and_triton_agree(model):
    pool = random_pool()
    ours = step_logits(model, "triton", "fp8", pool=pool)
    ref = step_logits(model, "torch", "fp8", pool=pool)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


def test_fp8_pool_is_close_to_the_full_precision_one(model):
    pool = random_pool()
    fp8 = step_logits(model, "torch", "fp8", pool=pool)
    full = step_logits(model, "torch", "auto", pool=pool)
    rel = ((fp8 - full).norm(dim=-1) / full.norm(dim=-1)).max()
    assert 0 < rel < 0.1, rel                      # quantization error, not a different answer


@pytest.mark.parametrize("window", [4, 11])
def test_sliding_window_torch_and_triton_agree(model, window):
    pool = random_pool(1)
    ours = step_logits(model, "triton", window=window, pool=pool)
    ref = step_logits(model, "torch", window=window, pool=pool)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    full = step_logits(model, "torch", pool=pool)
    assert (full - ref).abs().max() > 1e-3                    # the window is applied


@torch.no_grad()
def test_sliding_window_paged_prefill_matches_the_dense_forward(model):
    """A whole prompt through the paged path equals the cache-free forward with the same window."""
    prompt_len, window = 30, 6
    logits = step_logits(model, "torch", window=window, seqs=[(0, prompt_len, False)])
    runner = ModelRunner(model, 4, 16, 64)
    for layer in model.model.layers:
        layer.self_attn.kv = LayerKV(window=window)
    kv = KVCacheManager(4, 16, enable_caching=False)
    req = probe_batch(kv, [(0, prompt_len, False)], tag=0).reqs[0]
    ids = torch.from_numpy(req.token_ids(0, prompt_len, model.spec.vocab_size))
    hidden = model(ids, torch.arange(prompt_len), AttentionMetadata.dense([prompt_len], torch.device("cpu")))
    dense = model.compute_logits(hidden[-1:])
    runner.bind()
    torch.testing.assert_close(logits, dense, atol=1e-4, rtol=1e-4)
