"""The paged model against Hugging Face transformers, one tiny config per architecture.

Weights travel through save_pretrained -> engine.weights, so the loader is checked too.
Tolerance: fp32 throughout. The two implementations do the same arithmetic in a different
order (fused qkv/gate_up matmuls, SDPA instead of eager softmax(QK^T)V); each reordering
moves a result by a few fp32 ulps (~1e-7 relative), and two layers of matmuls over <= 256
terms leave logits of size 2-8 within ~2e-5 of each other (measured: 1.0-1.7e-5). A wrong
position, block or mask moves them by >= 1e-1, so atol=rtol=1e-4 separates the two cleanly.
(conftest.py sets TRITON_INTERPRET=1 without CUDA and one torch thread.)
"""
import importlib.util
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine.attention import TorchPagedAttention
from engine.kernels.reference import paged_attention_reference, write_kv_reference
from engine.runner import build_attn_metadata
from engine.weights import build_model, spec_from_hf_folder

TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK = 8

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
             initializer_range=0.15, rms_norm_eps=1e-6)
ARCHS = {
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SHAPE, rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**SHAPE, rope_theta=1e6, tie_word_embeddings=True)),
    # Llama 3.1's rope rescaling, with a short original context so all three bands are used.
    "llama3": (LlamaForCausalLM, lambda: LlamaConfig(
        **SHAPE, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    """(HF model, our model with the same weights, loaded from a saved checkpoint)."""
    cls, config = ARCHS[request.param]
    torch.manual_seed(0)
    hf = cls(config()).eval()
    with torch.no_grad():          # HF inits biases to 0 and norms to 1: perturb them so they count
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    spec = spec_from_hf_folder(folder)
    assert spec.weights == folder
    ours = build_model(spec, "cpu", attention_backend="torch")
    ours.bind_kv_cache(torch.zeros(spec.num_layers, 2, 64, BLOCK, spec.num_kv_heads, spec.head_dim))
    return hf, ours


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0].float()


@torch.inference_mode()
def paged_step(model, seqs):
    """One forward of sequences [(block ids, start position, new token ids)]; logits of every new token."""
    positions, meta = build_attn_metadata([s[0] for s in seqs], [s[1] for s in seqs],
                                          [len(s[2]) for s in seqs], BLOCK, torch.device("cpu"))
    hidden = model(torch.cat([s[2] for s in seqs]), positions, meta)
    return model.compute_logits(hidden).split([len(s[2]) for s in seqs])


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def test_param_count_matches_spec(pair):
    _, ours = pair
    assert sum(p.numel() for p in ours.parameters()) == ours.spec.num_params()


def test_full_prefill(pair):
    hf, ours = pair
    prompt = tokens(37, 1)                                   # 5 blocks, the last partly filled
    (logits,) = paged_step(ours, [([7, 3, 9, 1, 5], 0, prompt)])
    torch.testing.assert_close(logits, hf_logits(hf, prompt), **TOL)


def test_chunked_prefill(pair):
    hf, ours = pair
    prompt = tokens(37, 2)
    blocks = [12, 4, 30, 2, 17]
    (first,) = paged_step(ours, [(blocks, 0, prompt[:13])])   # chunk boundary inside a block
    (second,) = paged_step(ours, [(blocks, 13, prompt[13:])])
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf, prompt), **TOL)


def test_prefill_after_prefix_hit(pair):
    hf, ours = pair
    prefix, a_tail, b_tail = tokens(16, 3), tokens(9, 4), tokens(11, 5)
    paged_step(ours, [([20, 21, 22, 23], 0, torch.cat([prefix, a_tail]))])
    # B hits A's two full prefix blocks and computes only its own tail.
    (b_logits,) = paged_step(ours, [([20, 21, 40, 41], 16, b_tail)])
    torch.testing.assert_close(b_logits, hf_logits(hf, torch.cat([prefix, b_tail]))[16:], **TOL)


def test_prefix_hit_on_blocks_written_in_the_same_step(pair):
    """A registers its blocks at schedule time and B hits them in the same step: the K/V write
    for the whole batch must happen before any sequence attends."""
    hf, ours = pair
    prefix, a_tail, b_tail = tokens(24, 6), tokens(3, 7), tokens(5, 8)
    a = torch.cat([prefix, a_tail])
    a_logits, b_logits = paged_step(ours, [([50, 51, 52, 53], 0, a), ([50, 51, 52, 54], 24, b_tail)])
    torch.testing.assert_close(a_logits, hf_logits(hf, a), **TOL)
    torch.testing.assert_close(b_logits, hf_logits(hf, torch.cat([prefix, b_tail]))[24:], **TOL)


def test_batched_decode_of_mixed_lengths(pair):
    hf, ours = pair
    free = list(range(1, 64))
    random.Random(0).shuffle(free)                            # scattered physical blocks
    full = [tokens(n + 20, 10 + n) for n in (5, 17, 30)]      # prompt + 20 teacher-forced tokens
    seqs = [{"tokens": t, "len": len(t) - 20, "blocks": []} for t in full]

    def grow(seq, new_len):
        while len(seq["blocks"]) * BLOCK < new_len:
            seq["blocks"].append(free.pop())

    for s in seqs:
        grow(s, s["len"])
    prefill = paged_step(ours, [(s["blocks"], 0, s["tokens"][:s["len"]]) for s in seqs])
    got = [[p[-1]] for p in prefill]
    for _ in range(20):
        for s in seqs:
            grow(s, s["len"] + 1)
        step = paged_step(ours, [(s["blocks"], s["len"], s["tokens"][s["len"]:s["len"] + 1]) for s in seqs])
        for s, g, logits in zip(seqs, got, step):
            s["len"] += 1
            g.append(logits[0])
    for s, g in zip(seqs, got):
        want = hf_logits(hf, s["tokens"])[len(s["tokens"]) - 21:]   # the prompt's last row onward
        torch.testing.assert_close(torch.stack(g), want, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_torch_backend_matches_reference_attention(seed):
    """The vectorised CPU backend against the slow, obvious reference, on a mixed batch:
    decodes, a one-token prefill after a prefix hit, chunks with and without cached context."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, num_blocks = 8, 2, 32, 40
    starts, q_lens = [9, 30, 0, 16, 0, 47], [1, 1, 12, 1, 5, 20]
    free = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-(s + n) // BLOCK))] for s, n in zip(starts, q_lens)]
    _, meta = build_attn_metadata(tables, starts, q_lens, BLOCK, torch.device("cpu"))
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=g)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    k, v = torch.randn(2, sum(q_lens), kv_heads, d, generator=g)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, ref_k, ref_v, meta.slot_mapping)
    got = TorchPagedAttention(meta)(q, k, v, k_cache, v_cache, d ** -0.5)   # writes k/v, then attends
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    want = paged_attention_reference(q, ref_k, ref_v, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, d ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("engine.kernels.paged_attention") is None,
                    reason="engine/kernels/paged_attention.py not written yet")
def test_triton_backend_matches_torch_backend(pair):
    """One chunked-prefill step and one decode step through the Triton kernels (interpreted on CPU)."""
    hf, ours = pair
    prompt = tokens(21, 9)
    want = hf_logits(hf, prompt)
    ours.attention_backend = "triton"
    try:
        (first,) = paged_step(ours, [([3, 8, 5], 0, prompt[:20])])
        (decode,) = paged_step(ours, [([3, 8, 5], 20, prompt[20:])])
    finally:
        ours.attention_backend = "torch"
    # The kernels' own tolerance against the reference is 2e-4 in fp32 (docs/engine.md, "The CPU path").
    torch.testing.assert_close(torch.cat([first, decode]), want, atol=5e-4, rtol=5e-4)
