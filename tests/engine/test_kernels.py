"""Triton kernels vs the torch references. Without CUDA they run through the Triton
interpreter, so shapes stay small (programs x context tiles per launch in the tens)."""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():  # before the kernels are decorated (tests/conftest.py does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import engine.kernels as kernels  # noqa: E402
from engine.kernels import (AttentionConfig, paged_attention, paged_attention_reference,  # noqa: E402
                            write_kv, write_kv_reference)
from engine.kernels.paged_attention import default_config, use_split_kv  # noqa: E402
from engine.kernels.testing import make_attention_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DECODE_TILES = AttentionConfig(block_m=16, tile_size=16)            # small tiles: many programs/tiles
SPLIT4 = AttentionConfig(block_m=16, tile_size=16, num_segments=4)


def check_attention(q_lens, seq_lens, heads=(4, 2), head_dim=32, block_size=16, dtype=F32,
                    split=False, config=None, seed=0):
    num_heads, num_kv_heads = heads
    inputs = make_attention_inputs(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                   dtype, device=DEVICE, seed=seed)
    out = paged_attention(**inputs, force_split=split, config=config)
    del inputs["max_query_len"], inputs["max_seq_len"]
    ref = paged_attention_reference(**inputs, out=torch.empty(out.shape, dtype=F32, device=DEVICE))
    err = (out.float() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err:.3g} >= {TOL[dtype]}"


# (q_lens, seq_lens): query i of a sequence sits at position seq_len - q_len + i.
SCENARIOS = {
    "prefill": ([13, 40], [13, 40]),
    "chunk": ([16], [40]),                   # second chunk of a 40-token prompt, first 24 cached
    "prefix_hit": ([5, 3], [37, 19]),        # only the tail after a prefix-cache hit is new
    "decode": ([1, 1, 1], [1, 17, 40]),
    "mixed": ([1, 9, 0, 20, 1], [33, 9, 5, 50, 1]),   # with a sequence that has no new tokens
}


CONFIGS = pytest.mark.parametrize("config", [None, DECODE_TILES], ids=["default_cfg", "decode_cfg"])


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@CONFIGS
def test_scenarios(scenario, dtype, config):
    check_attention(*SCENARIOS[scenario], dtype=dtype, config=config)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (14, 2)], ids=["mha", "group2", "group7"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
def test_gqa_dtypes(heads, dtype):
    check_attention([1, 7, 12], [21, 7, 30], heads=heads, dtype=dtype, config=DECODE_TILES)


@pytest.mark.parametrize("block_size", [1, 3, 16, 32, 48])
@CONFIGS
def test_block_sizes(block_size, config):
    check_attention([1, 6, 1], [35, 29, 50], block_size=block_size, config=config)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_head_dims(head_dim, dtype):
    check_attention([1, 5], [26, 18], head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("split", [False, True], ids=["2d", "split"])
def test_decode_split_kv(dtype, split):
    check_attention([1, 1], [45, 70], heads=(14, 2), head_dim=64, dtype=dtype, split=split, config=SPLIT4)


def test_split_kv_chosen_by_heuristic_for_long_decode():
    cfg = default_config(True, 2, 32, F16)
    seq_lens = [cfg.num_segments * cfg.tile_size + 5, 300]
    assert use_split_kv(1, 2, 2, max(seq_lens), cfg, num_sms=132)
    check_attention([1, 1], seq_lens, dtype=F16, split=None)


def test_split_kv_more_segments_than_tiles():
    """Empty segments must not disturb the merge (they carry max -inf, sum 0)."""
    check_attention([1, 1], [3, 20], split=True, config=AttentionConfig(16, 16, num_segments=8))


def test_split_kv_with_prefill_rows():
    """Forcing the split path on a mixed batch stays correct: a segment past a row's causal
    limit leaves that row fully masked."""
    check_attention([1, 5, 9], [33, 9, 40], split=True, config=SPLIT4)


def test_default_configs_and_split_heuristic():
    assert default_config(True, 7, 64, F16).block_m == 16          # 2 tokens x 7 heads, padded
    assert default_config(False, 4, 128, BF16).block_m == 128
    assert default_config(True, 32, 128, F16).block_m == 32
    cfg = default_config(True, 4, 128, F16)
    long_ctx = cfg.num_segments * cfg.tile_size
    assert use_split_kv(1, 4, 8, long_ctx, cfg, num_sms=132)
    assert not use_split_kv(1, 4, 8, long_ctx - 1, cfg, num_sms=132)   # too short to split
    assert not use_split_kv(1, 64, 8, 32768, cfg, num_sms=132)          # batch fills the GPU
    assert not use_split_kv(16, 1, 8, 32768, cfg, num_sms=132)          # not decode-only


def test_strided_q_and_out():
    """q as a view into a fused qkv buffer and a caller-provided out with padded rows."""
    inputs = make_attention_inputs([3, 1], [10, 20], 4, 2, 32, 16, device=DEVICE)
    q = inputs["q"]
    qkv = torch.randn(q.shape[0], 8, 32, device=DEVICE)
    qkv[:, :4] = q
    out = torch.full((q.shape[0], 6, 32), float("nan"), device=DEVICE)[:, 1:5]
    inputs["q"] = qkv[:, :4]
    assert paged_attention(**inputs, out=out, config=DECODE_TILES) is out
    del inputs["max_query_len"], inputs["max_seq_len"]
    torch.testing.assert_close(out, paged_attention_reference(**inputs), atol=2e-4, rtol=0)


def test_chunked_prefill_then_decode_through_write_kv():
    """A 40-token prompt in chunks of 24 and 16 (the second attends to the first through the
    cache), then one decode step, all equal to attending over the whole sequence at once."""
    heads, kv_heads, d, bs = 4, 2, 32, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(41, h, d, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    k_cache = torch.zeros(6, bs, kv_heads, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[4, 0, 2, 5]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(41, device=DEVICE)
    slots = block_tables[0, pos // bs].long() * bs + pos % bs
    outs = []
    for lo, hi in ((0, 24), (24, 40), (40, 41)):
        write_kv(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi])
        meta = dict(block_tables=block_tables, seq_lens=torch.tensor([hi], dtype=torch.int32, device=DEVICE),
                    query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE), scale=d ** -0.5)
        outs.append(paged_attention(q[lo:hi], k_cache, v_cache, **meta, max_query_len=hi - lo, max_seq_len=hi,
                                    config=DECODE_TILES))
    causal = torch.ones(41, 41, dtype=torch.bool, device=DEVICE).tril()
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal, scale=d ** -0.5,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs), dense, atol=2e-4, rtol=0)


def test_empty_batch():
    inputs = make_attention_inputs([0], [4], 4, 2, 32, 16, device=DEVICE)
    assert paged_attention(**inputs).shape == (0, 4, 32)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(2, 32, 16), (3, 48, 3)])
def test_write_kv_bit_exact(dtype, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 7, 12
    key, value = (torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in "kv")
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::4] = -1                                        # padding tokens are skipped
    slots = slots.to(DEVICE)
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv(key, value, *caches, slots)
    write_kv_reference(key, value, *expected, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


def test_write_kv_int32_slots_and_empty():
    key = torch.randn(2, 2, 32, device=DEVICE)
    k_cache, v_cache = torch.zeros(2, 4, 2, 32, device=DEVICE), torch.zeros(2, 4, 2, 32, device=DEVICE)
    write_kv(key, key, k_cache, v_cache, torch.tensor([5, -1], dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_cache[1, 1], key[0]) and k_cache.count_nonzero() == key[0].numel()
    write_kv(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))


def _bad_attention_args(change):
    inputs = make_attention_inputs([2, 1], [5, 9], 4, 2, 32, 16)
    change(inputs)
    return inputs


@pytest.mark.parametrize("change,name", [
    (lambda a: a.update(q=a["q"].half()), "k_cache"),
    (lambda a: a.update(q=a["q"][:, :3]), "q has 3 heads"),
    (lambda a: a.update(q=a["q"][..., :16]), "q must have shape"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :24], v_cache=a["v_cache"][..., :24],
                        q=a["q"][..., :24]), "head_dim"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "query_start_loc"),
    (lambda a: a.update(v_cache=a["v_cache"][:1]), "v_cache"),
    (lambda a: a.update(out=torch.empty(3, 4, 32, dtype=F16)), "out"),
    (lambda a: a.update(config=AttentionConfig(block_m=24, tile_size=16)), "block_m"),
    (lambda a: a.update(config=AttentionConfig(block_m=16, tile_size=16, num_segments=1)), "num_segments"),
], ids=["dtype", "heads", "q_dim", "head_dim", "bt_dtype", "seq_lens", "qsl", "v_cache", "out", "block_m",
        "segments"])
def test_attention_rejects_bad_inputs(change, name):
    with pytest.raises(ValueError, match=name):
        paged_attention(**_bad_attention_args(change))


def test_write_kv_rejects_bad_inputs():
    key = torch.randn(3, 2, 32)
    cache = torch.zeros(4, 16, 2, 32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, key, cache, cache.clone(), torch.zeros(3))
    with pytest.raises(ValueError, match="value"):
        write_kv(key, key[:2], cache, cache.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="key"):
        write_kv(key[:, :1], key[:, :1], cache, cache.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="key dtype"):
        write_kv(key.half(), key.half(), cache, cache.clone(), torch.zeros(3, dtype=torch.int64))


def test_triton_available_and_lazy_exports():
    assert kernels.triton_available()
    assert kernels.paged_attention is paged_attention and "write_kv" in kernels.__all__
    with pytest.raises(AttributeError):
        kernels.no_such_kernel  # noqa: B018
