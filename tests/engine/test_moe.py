"""The MoE decoder layer (torch reference path) against transformers' Mixtral and Qwen3-MoE
layers, tiny random configs: the same weights, the same tokens, the same outputs.

The whole decoder layer is compared (norms, attention with rotary embeddings, the sparse MoE
block, residuals): ours runs the sequence through the dense attention path (what the
profiling forward and the unpaged oracle use), theirs with a causal mask."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.attention import AttentionMetadata, make_attention  # noqa: E402
from engine.model import TORCH_OPS, DecoderLayer, RotaryEmbedding  # noqa: E402
from engine.moe import MoE, MoESpec  # noqa: E402
from sim.core.catalog import ModelSpec  # noqa: E402

TOKENS = 11


def mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

    cfg = MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=6, num_experts_per_tok=2, num_hidden_layers=1, vocab_size=100,
                        max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6)
    spec = ModelSpec(architecture="llama", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=96, vocab_size=100, rms_norm_eps=1e-6)
    return cfg, spec, MoESpec.mixtral(64, 6, 2, 96), MixtralDecoderLayer(cfg, 0), MixtralRotaryEmbedding(cfg)


def qwen3_moe(norm_topk_prob=True):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=norm_topk_prob, num_hidden_layers=1, vocab_size=100,
                         max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                         decoder_sparse_step=1, mlp_only_layers=[])
    spec = ModelSpec(architecture="qwen3", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=32, intermediate_size=128, vocab_size=100, rms_norm_eps=1e-6)
    moe = MoESpec.qwen3_moe(64, 8, 3, 48, norm_topk_prob=norm_topk_prob)
    return cfg, spec, moe, Qwen3MoeDecoderLayer(cfg, 0), Qwen3MoeRotaryEmbedding(cfg)


def copy_weights(theirs, ours) -> None:
    """HF's names onto ours: q/k/v into qkv_proj, MoE tensors as they are."""
    t = dict(theirs.named_parameters())
    a = ours.self_attn
    a.qkv_proj.weight.copy_(torch.cat([t[f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    a.o_proj.weight.copy_(t["self_attn.o_proj.weight"])
    for norm in ("input_layernorm", "post_attention_layernorm"):
        getattr(ours, norm).weight.copy_(t[f"{norm}.weight"])
    if a.qk_norm:
        a.q_norm.weight.copy_(t["self_attn.q_norm.weight"])
        a.k_norm.weight.copy_(t["self_attn.k_norm.weight"])
    ours.mlp.gate.weight.copy_(t["mlp.gate.weight"])
    ours.mlp.experts.gate_up_proj.copy_(t["mlp.experts.gate_up_proj"])
    ours.mlp.experts.down_proj.copy_(t["mlp.experts.down_proj"])


def randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@torch.no_grad()
def compare(make, dtype, seed=0):
    cfg, spec, moe, theirs, their_rotary = make()
    randomize(theirs, seed)
    theirs = theirs.to(dtype).eval()
    ours = DecoderLayer(spec, dtype, moe)
    copy_weights(theirs, ours)
    x = torch.randn(1, TOKENS, 64, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    positions = torch.arange(TOKENS)
    cos, sin = their_rotary(x, positions[None])
    mask = torch.full((TOKENS, TOKENS), float("-inf")).triu(1).to(dtype)[None, None]
    cfg._attn_implementation = "eager"
    want = theirs(x, position_embeddings=(cos, sin), attention_mask=mask, position_ids=positions[None])
    want = want[0] if isinstance(want, tuple) else want
    attention = make_attention("torch", AttentionMetadata.dense([TOKENS], torch.device("cpu")))
    rotary = RotaryEmbedding(spec, 64)
    h, residual = ours(x[0], None, positions, rotary, attention, TORCH_OPS)
    return h + residual, want[0]


VARIANTS = dict(argnames="make", argvalues=[mixtral, qwen3_moe, lambda: qwen3_moe(False)],
                ids=["mixtral", "qwen3-moe", "qwen3-moe-unnormalized"])


@pytest.mark.parametrize(**VARIANTS)
def test_moe_decoder_layer_matches_transformers(make):
    """fp32: in 16-bit types a near-tie between two experts' router probabilities can route a
    token differently after the attention's own rounding, so the layer is compared in fp32 and
    the MoE block alone (same input, same routing) in bf16 below."""
    got, want = compare(make, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(**VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_moe_block_matches_transformers(make, dtype):
    _, _, moe, theirs, _ = make()
    randomize(theirs, 3)
    theirs = theirs.to(dtype)
    ours = MoE(moe, dtype)
    ours.gate.weight.copy_(theirs.mlp.gate.weight)
    ours.experts.gate_up_proj.copy_(theirs.mlp.experts.gate_up_proj)
    ours.experts.down_proj.copy_(theirs.mlp.experts.down_proj)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = theirs.mlp(x)
    want = want[0] if isinstance(want, tuple) else want
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours(x[0]), want[0], **tol)


def test_routing_picks_distinct_experts_and_weights_sum_to_one():
    moe = MoE(MoESpec.mixtral(16, 8, 2, 8), torch.float32)
    randomize(moe, 5)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(6))
    weights, experts = moe.route(x)
    assert (experts[:, 0] != experts[:, 1]).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    assert 2 <= moe.experts_used(x[:1]) <= 2 and moe.experts_used(x) > 2   # decode reads more experts at batch


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        MoESpec.mixtral(16, 4, 5, 8)


def test_a_catalog_moe_model_builds_and_runs_a_step():
    """A tiny Qwen3-MoE-shaped catalog model through the engine (paged, torch backend)."""
    from engine.runner import ModelRunner
    from engine.weights import build_model
    from sim.core.kv import KVCacheManager
    from validate.calibrate import probe_batch

    spec = ModelSpec(name="tiny-moe", architecture="qwen3", num_layers=2, hidden_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=100, dtype="float32",
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    model = build_model(spec, "cpu")
    assert isinstance(model.model.layers[0].mlp, MoE) and model.model.layers[0].mlp.spec.renormalize
    runner = ModelRunner(model, 9, 16, 64)
    kv = KVCacheManager(9, 16, enable_caching=False)
    result = runner.execute(probe_batch(kv, [(0, 20, False), (0, 7, False)], tag=0))
    assert result.logits.shape == (2, 100) and torch.isfinite(result.logits).all()
    mixtral_like = spec.model_copy(update={"architecture": "llama"})
    assert MoESpec.from_model(mixtral_like).fp32_weights


def test_the_engine_refuses_what_it_does_not_build():
    from engine.weights import build_model

    spec = ModelSpec(name="shared", architecture="qwen2", num_layers=1, hidden_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=100, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    with pytest.raises(NotImplementedError, match="shared experts"):
        build_model(spec, "cpu")


def test_quantized_weights_are_simulator_only():
    from engine.weights import build_model
    from sim.core.catalog import WeightQuant

    spec = ModelSpec(name="q", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=100, quantization=WeightQuant(method="fp8"))
    with pytest.raises(NotImplementedError, match="simulator-only"):
        build_model(spec, "cpu")
