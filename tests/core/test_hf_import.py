"""Importing real public config.json files: each is modelled with the right figures or refused
naming the field, never silently mis-modelled. Corpus: tests/data/hf_configs (SOURCES.md)."""
from pathlib import Path

import pytest

from sim.core.catalog import ModelSpec, WeightQuant
from sim.core.hf_config import UnsupportedConfigError, fields_from_config, model_fields_from_hf_config
from sim.scenario import ScenarioError, validate_scenario

CORPUS = Path(__file__).parents[1] / "data" / "hf_configs"

# file -> (billions of parameters, weight GB, quantization method, sliding layers, experts)
IMPORTED = {
    "meta-llama__Meta-Llama-3.1-8B.json": (8.03, 16.06, None, 0, 0),
    "Qwen__Qwen3-8B.json": (8.19, 16.38, None, 0, 0),
    "Qwen__Qwen3-0.6B.json": (0.60, 1.19, None, 0, 0),                 # tied embeddings
    "Qwen__Qwen3-32B-FP8.json": (32.76, 34.33, "fp8", 0, 0),            # block scales
    "Qwen__Qwen3-30B-A3B.json": (30.53, 61.06, None, 0, 128),
    "Qwen__Qwen3-30B-A3B-FP8.json": (30.53, 31.17, "fp8", 0, 128),
    "CarbonLover__krx_qwen2.5_it_test.json": (7.62, 15.23, None, 0, 0),  # use_sliding_window false
    "Qwen__Qwen2-72B-Instruct.json": (72.71, 145.41, None, 0, 0),        # window set but not used
    "mistralai__Mixtral-8x7B-v0.1.json": (46.70, 93.41, None, 0, 8),
    "Zangs3011__mistral-7b-metamath.json": (7.24, 14.48, None, 32, 0),   # Mistral v0.1: every layer
    "lunahr__SystemGemma2-27b-it.json": (27.23, 54.45, None, 23, 0),     # even layers local
    "2point5p__krx-gemma2-9b-harvest.json": (9.24, 18.48, None, 21, 0),
    "Codingstark__gemma3-270m-leetcode.json": (0.27, 0.54, None, 15, 0),  # layer_types 5:1
    "PatronusAI__Llama-3.1-70B-Instruct-AWQ-INT4.json": (70.55, 39.77, "awq", 0, 0),
    "Sumail__Llama-3.1-8B-Instruct-125m-4bit.json": (8.03, 5.70, "gptq", 0, 0),
    "openai__gpt-oss-20b.json": (20.91, 13.76, "mxfp4", 12, 32),        # mxfp4 experts only
    "openai__gpt-oss-120b.json": (116.83, 65.25, "mxfp4", 18, 128),    # model card: 116.8B
    "Qwen__Qwen3-235B-A22B.json": (235.09, 470.19, None, 0, 128),       # model card: 235B, 22B active
    "Qwen__Qwen3-235B-A22B-FP8.json": (235.09, 236.45, "fp8", 0, 128),
    "codellama__CodeLlama-34b-Instruct-hf.json": (33.74, 67.49, None, 0, 0),  # GQA 64/8, untied
}
# file -> the field the refusal must name
REFUSED = {
    "deepseek-ai__DeepSeek-V3.json": "kv_lora_rank",
    "nvidia__Llama-3.1-70B-Instruct-FP8.json": "quantization_config",   # scheme in a side file
    "Alignment-Lab-AI__idfkphi4kiguess.json": "architectures",           # Phi-3
}


def test_every_corpus_file_has_an_expected_outcome():
    files = {p.name for p in CORPUS.glob("*.json")}
    assert len(files) >= 18
    assert files == set(IMPORTED) | set(REFUSED), "a new corpus file needs an expected outcome here"


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_imported_with_the_right_figures(name):
    params_b, weight_gb, method, sliding, experts = IMPORTED[name]
    model = ModelSpec(**model_fields_from_hf_config(CORPUS / name))
    assert model.num_params() / 1e9 == pytest.approx(params_b, abs=0.01)
    assert model.weight_bytes() / 1e9 == pytest.approx(weight_gb, abs=0.01)
    assert (model.quantization.method if model.quantization else None) == method
    assert model.num_sliding_layers == sliding
    assert model.num_experts == experts


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_naming_the_field(name):
    with pytest.raises(UnsupportedConfigError, match=REFUSED[name]):
        model_fields_from_hf_config(CORPUS / name)


def test_published_parameter_counts():
    """Sizes the model cards state: Mixtral 46.7B, Qwen3-30B-A3B 30.5B, gpt-oss-20b 20.9B (of
    which mxfp4 experts make a 12.8 GiB checkpoint), Gemma-2-9B 9.24B."""
    counts = {n: ModelSpec(**model_fields_from_hf_config(CORPUS / n)).num_params() / 1e9 for n in IMPORTED}
    assert counts["mistralai__Mixtral-8x7B-v0.1.json"] == pytest.approx(46.7, abs=0.1)
    assert counts["Qwen__Qwen3-30B-A3B.json"] == pytest.approx(30.5, abs=0.1)
    assert counts["openai__gpt-oss-20b.json"] == pytest.approx(20.9, abs=0.1)
    assert counts["2point5p__krx-gemma2-9b-harvest.json"] == pytest.approx(9.24, abs=0.02)


def test_quantization_details_are_read():
    awq = model_fields_from_hf_config(CORPUS / "PatronusAI__Llama-3.1-70B-Instruct-AWQ-INT4.json")["quantization"]
    assert (awq.group_size, awq.zero_point, awq.quantized_activations) == (128, True, False)
    gptq = model_fields_from_hf_config(CORPUS / "Sumail__Llama-3.1-8B-Instruct-125m-4bit.json")["quantization"]
    assert (gptq.group_size, gptq.zero_point, gptq.act_order) == (128, False, False)
    fp8 = model_fields_from_hf_config(CORPUS / "Qwen__Qwen3-32B-FP8.json")["quantization"]
    assert (fp8.scales, fp8.block) == ("block", (128, 128))
    oss = model_fields_from_hf_config(CORPUS / "openai__gpt-oss-20b.json")
    assert oss["quantization"].experts_only and oss["max_position_embeddings"] == 131072   # yarn 32 x 4096


def test_gemma3_pattern_and_gemma2_alternation():
    gemma3 = model_fields_from_hf_config(CORPUS / "Codingstark__gemma3-270m-leetcode.json")
    assert gemma3["layer_types"][5] == "full_attention" and gemma3["layer_types"][:5] == ["sliding_attention"] * 5
    gemma2 = model_fields_from_hf_config(CORPUS / "lunahr__SystemGemma2-27b-it.json")
    assert gemma2["layer_types"][:2] == ["sliding_attention", "full_attention"] and gemma2["tie_word_embeddings"]


BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


@pytest.mark.parametrize("extra, field", [
    ({"some_new_field": 1}, "some_new_field"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "awq", "bits": 3, "group_size": 128}}, "bits"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                              "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}}, "modules_to_not_convert"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "mrope"}}, "rope_scaling"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"vision_config": {}}, "vision_config"),
])
def test_fields_that_change_memory_or_cost_are_refused_by_name(extra, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        fields_from_config({**BASE, **extra})


def test_torch_dtype_and_dtype_that_differ_are_refused_and_either_alone_is_read():
    """transformers (4.56 on) keeps `dtype` when both are given; kvtwin read `torch_dtype` silently."""
    with pytest.raises(UnsupportedConfigError, match="torch_dtype 'bfloat16' and dtype 'float32' differ"):
        fields_from_config({**BASE, "torch_dtype": "bfloat16", "dtype": "float32"})
    assert fields_from_config({**BASE, "dtype": "float32"})["dtype"] == "float32"
    assert fields_from_config({**BASE, "torch_dtype": "float16", "dtype": "float16"})["dtype"] == "float16"


def test_compressed_tensors_schemes():
    group = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}
    q = fields_from_config({**BASE, "quantization_config": group})["quantization"]
    assert (q.method, q.scales, q.quantized_activations) == ("fp8", "channel", True)
    group["config_groups"]["g"]["weights"] = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                              "symmetric": True}
    group["config_groups"]["g"]["input_activations"] = None
    q = fields_from_config({**BASE, "quantization_config": group})["quantization"]
    assert (q.method, q.group_size, q.quantized_activations) == ("gptq", 128, False)


def test_yarn_extends_the_context_as_vllm_derives_max_model_len():
    fields = fields_from_config({**BASE, "max_position_embeddings": 32768,
                                 "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}})
    assert fields["max_position_embeddings"] == 131072


def test_weight_bytes_per_format():
    """Bytes of a 4096 x 4096 matrix: fp8 per channel 1 B + 4 B per row; AWQ 0.5 B + per 128-group
    an fp16 scale and a 4-bit zero; GPTQ symmetric without zeros; fp8 blocks one fp32 per 128 x 128."""
    n = 4096 * 4096
    assert WeightQuant(method="fp8", scales="channel").matrix_bytes(4096, 4096) == n + 4 * 4096
    assert WeightQuant(method="fp8", scales="tensor").matrix_bytes(4096, 4096) == n + 4
    assert WeightQuant(method="fp8", scales="block", block=(128, 128)).matrix_bytes(4096, 4096) == n + 4 * 32 * 32
    groups = 32 * 4096
    assert WeightQuant(method="awq", group_size=128, zero_point=True).matrix_bytes(4096, 4096) == n // 2 + 2.5 * groups
    assert WeightQuant(method="gptq", group_size=128).matrix_bytes(4096, 4096) == n // 2 + 2 * groups
    assert WeightQuant(method="mxfp4").matrix_bytes(4096, 4096) == n // 2 + n // 32


def test_scenario_hf_config_refusal_names_file_and_field():
    with pytest.raises(ScenarioError, match="DeepSeek-V3.json.*kv_lora_rank"):
        validate_scenario({"model": {"hf_config": str(CORPUS / "deepseek-ai__DeepSeek-V3.json")}, "device": "h200"})
