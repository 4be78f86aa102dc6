"""Hugging Face config.json -> ModelSpec fields, never silently.

Every key of a config is either read (it changes memory or cost and is modelled), known to
change neither (HARMLESS), or refused with an error naming the key. A config with a key this
module has never seen is refused too: a new field may change the KV cache or the weights, and
a capacity plan that quietly ignores it would be wrong without a word.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sim.core.quantization import WeightQuant
from sim.core.files import check_bounded, excerpt, read_json


class UnsupportedConfigError(ValueError):
    """A config.json field kvtwin cannot model; the message names the field."""


# config.json key -> ModelSpec field, copied as is.
DIRECT = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}

# Keys read below with their own rules (quantization, windows, experts, rope, dtype).
READ = {"architectures", "_name_or_path", "intermediate_size", "torch_dtype", "dtype", "rope_scaling",
        "rope_parameters", "quantization_config", "sliding_window", "use_sliding_window",
        "max_window_layers", "layer_types", "sliding_window_pattern", "sliding_window_size",
        "num_local_experts", "num_experts", "num_experts_per_tok", "experts_per_token",
        "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts",
        "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace", "kv_lora_rank",
        "q_lora_rank", "attention_bias", "mlp_bias", "text_config", "vision_config",
        "attention_chunk_size", "model_type", "num_nextn_predict_layers", "_sliding_window_pattern",
        "use_bidirectional_attention"}

# transformers' per-family default where a config omits tie_word_embeddings (Gemma ties).
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text"}
# Words in a checkpoint's name that say its weights are quantized.
_QUANTIZED_NAMES = ("fp8", "awq", "gptq", "int4", "int8", "w4a16", "w8a8", "4bit", "8bit", "nvfp4", "mxfp4")

# Keys that change neither memory nor step cost in our model (token ids, training-only
# settings, activation function choice within the same GEMM shapes, logit soft-capping, norms'
# epsilons, the rope base of local layers, ...). Reviewed one by one against the corpus.
HARMLESS = {
    "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "hidden_act",
    "hidden_activation", "initializer_range", "attention_dropout", "use_cache", "pretraining_tp",
    "auto_map", "output_router_logits", "router_aux_loss_coef", "router_z_loss_coef", "norm_topk_prob",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "cache_implementation",
    "rope_local_base_freq", "swiglu_limit", "initial_context_length", "router_jitter_noise",
    "bos_token", "eos_token", "unsloth_fixed", "use_qk_norm", "layer_norm_eps", "embedding_dropout",
    "residual_dropout", "is_decoder", "tokenizer_class", "torchscript", "use_bfloat16",
    "mlp_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "classifier_dropout",
    "qkv_bias_init", "use_return_dict", "output_attentions", "output_hidden_states",
    "chat_template", "generation_config", "eos_token_ids", "rope_type", "_attn_implementation",
    "_attn_implementation_autoset", "unsloth_version", "attn_implementation",
}

# The JSON type each read key must have (null = absent, as transformers reads it). transformers
# itself does not coerce: "512" or "yes" in a config.json is a broken file, not a number or a flag.
WHOLE = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "vocab_size", "max_position_embeddings", "intermediate_size", "sliding_window", "sliding_window_size",
         "max_window_layers", "num_local_experts", "num_experts", "num_experts_per_tok", "experts_per_token",
         "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts", "decoder_sparse_step",
         "sliding_window_pattern", "_sliding_window_pattern", "first_k_dense_replace", "kv_lora_rank",
         "q_lora_rank", "attention_chunk_size", "num_nextn_predict_layers")
REAL = ("rope_theta", "rms_norm_eps")
FLAGS = ("tie_word_embeddings", "use_sliding_window", "attention_bias", "mlp_bias", "use_bidirectional_attention")
MAX_ROPE_KEYS = 32          # HF's rope_scaling holds a handful of settings (and two short factor lists)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen3", "Gemma2ForCausalLM": "llama", "Gemma3ForCausalLM": "llama",
    "GptOssForCausalLM": "llama",
}
# The gate/router, the LM head, embeddings and norms: what quantized checkpoints leave out
# and we keep in the model dtype anyway.
_UNQUANTIZED_ANYWAY = ("lm_head", "router", "embed", "norm", "sinks")
_UNQUANTIZED_LAST = ("gate", "shared_expert_gate")     # MoE routers, by their last name component


def model_fields_from_hf_config(path: Path) -> dict[str, Any]:
    """Read a Hugging Face config.json (or a folder holding one) into ModelSpec fields."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_file = path / "config.json" if path.is_dir() else path
    cfg = read_json(config_file, "Hugging Face config.json")   # bounded; errors name the file
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file}: a JSON {type(cfg).__name__}, expected an object (a Hugging Face config)")
    try:
        if cfg.get("quantization_config") is None:
            cfg = {**cfg, "quantization_config": _separate_quant_config(folder, config_file, cfg)}
        fields = fields_from_config(cfg)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{config_file}: {e}") from None
    except (TypeError, AttributeError, KeyError, ZeroDivisionError) as e:   # a field of an unexpected type
        raise ValueError(f"{config_file}: a field has an unexpected type or value "
                         f"({type(e).__name__}: {excerpt(str(e), 120)})") from None
    fields.setdefault("name", folder.name if path.is_dir() else config_file.stem)
    if any(folder.glob("*.safetensors")):
        fields["weights"] = folder
    return fields


def fields_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec fields from a parsed config.json; UnsupportedConfigError names what is refused."""
    _refuse_unmodelled(cfg)
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise UnsupportedConfigError(f"architectures is {excerpt(archs)}, expected a list of class names")
    arch = next((ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedConfigError(f"architectures {excerpt(archs, 120)} not supported "
                                     f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    _refuse_unknown_keys(cfg)
    _check_types(cfg)
    _check_shape(cfg)
    fields: dict[str, Any] = {"architecture": arch}
    name = str(cfg.get("_name_or_path") or "")
    if name.count("/") == 1 and not name.startswith(("/", ".")):     # an org/repo id, not a local path
        fields["name"] = name
    if cfg.get("tie_word_embeddings") is None and cfg.get("model_type") in _TIED_BY_DEFAULT:
        fields["tie_word_embeddings"] = True
    for hf_key, ours in DIRECT.items():
        if cfg.get(hf_key) is not None:
            fields[ours] = cfg[hf_key]
    dtype = _dtype(cfg)
    if dtype is not None:
        fields["dtype"] = dtype
    if "num_kv_heads" not in fields and "num_heads" in fields:
        fields["num_kv_heads"] = fields["num_heads"]
    if "head_dim" not in fields and "num_heads" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    if cfg.get("attention_bias"):
        fields["attention_bias"] = True
    if cfg.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias: true is not modelled (MLP biases)")
    if cfg.get("intermediate_size") is not None:
        fields["intermediate_size"] = cfg["intermediate_size"]
    fields.update(_rope(cfg, fields))
    fields.update(_sliding_window(cfg, fields.get("num_layers")))
    fields.update(_experts(cfg))
    if cfg.get("quantization_config") is not None:
        fields["quantization"] = quantization_from_config(cfg["quantization_config"])
    return fields


def _separate_quant_config(folder: Path, config_file: Path, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """ModelOpt checkpoints keep their scheme in hf_quant_config.json beside config.json; a config
    whose name says it is quantized but that carries no scheme is refused, not planned in 16 bits."""
    side = folder / "hf_quant_config.json"
    if side.is_file():
        try:
            algo = read_json(side, "ModelOpt hf_quant_config.json").get("quantization", {}).get("quant_algo")
        except (ValueError, AttributeError):
            raise UnsupportedConfigError(f"{side}: not a valid ModelOpt hf_quant_config.json") from None
        if str(algo).upper() == "FP8":
            return {"quant_method": "fp8"}
        raise UnsupportedConfigError(f"{side}: quantization.quant_algo '{algo}' is not modelled (FP8)")
    names = f"{cfg.get('_name_or_path', '')} {config_file.stem} {folder.name}".lower()
    hit = next((w for w in _QUANTIZED_NAMES if w in names), None)
    if hit:
        raise UnsupportedConfigError(
            f"quantization_config: absent, yet the checkpoint's name says '{hit}'. Its scheme may live in a "
            "separate file (ModelOpt's hf_quant_config.json); set model.quantization explicitly "
            "(e.g. {method: fp8, scales: tensor}) rather than planning 16-bit weights")
    return None


def _dtype(cfg: dict) -> Any:
    """The weights' dtype: `dtype` (transformers 4.56 on) or `torch_dtype` (before). Two that differ
    are refused: transformers keeps `dtype`, an older reader `torch_dtype`, and the file alone
    cannot say which its writer meant."""
    old, new = cfg.get("torch_dtype"), cfg.get("dtype")
    if old is not None and new is not None and old != new:
        raise UnsupportedConfigError(f"torch_dtype {excerpt(old)} and dtype {excerpt(new)} differ; expected one "
                                     f"dtype (transformers keeps dtype, older readers torch_dtype)")
    return new if new is not None else old


def _refuse_unknown_keys(cfg: dict[str, Any]) -> None:
    unknown = sorted(k for k in cfg if k not in DIRECT and k not in READ and k not in HARMLESS)
    if unknown:
        raise UnsupportedConfigError(
            f"field '{unknown[0]}' is not known to kvtwin"
            + (f" (nor {', '.join(repr(k) for k in unknown[1:4])}{'...' if len(unknown) > 4 else ''})"
               if len(unknown) > 1 else "")
            + "; it may change memory or cost, so the config is refused rather than half-read. "
              "Describe the model with explicit ModelSpec fields instead")


def _check_types(cfg: dict[str, Any]) -> None:
    """Each read value has its JSON type: whole numbers >= 0, finite numbers, true/false."""
    for key in WHOLE:
        value = cfg.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise UnsupportedConfigError(f"{key} is {excerpt(value)}, expected a whole number >= 0")
    for key in REAL:
        value = cfg.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
            raise UnsupportedConfigError(f"{key} is {excerpt(value)}, expected a finite number > 0")
    for key in FLAGS:
        value = cfg.get(key)
        if value is not None and type(value) is not bool:
            raise UnsupportedConfigError(f"{key} is {excerpt(value)}, expected true or false")


def _check_shape(cfg: dict[str, Any]) -> None:
    """What transformers' model classes need of the attention shape, checked before it is derived."""
    hidden, heads, kv_heads = cfg.get("hidden_size"), cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not hidden or not heads:
        missing = "hidden_size" if not hidden else "num_attention_heads"
        raise UnsupportedConfigError(f"{missing} is {excerpt(cfg.get(missing))}, expected a whole number > 0")
    if cfg.get("head_dim") is None and hidden % heads:
        raise UnsupportedConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                                     f"(without head_dim, a head is hidden_size / num_attention_heads wide)")
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise UnsupportedConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def _refuse_unmodelled(cfg: dict[str, Any]) -> None:
    if cfg.get("kv_lora_rank"):
        raise UnsupportedConfigError(
            "kv_lora_rank: multi-head latent attention (MLA, DeepSeek-V2/V3 style) is not modelled: its "
            "KV cache holds one compressed latent per token, not K and V per head")
    if cfg.get("text_config") is not None or cfg.get("vision_config") is not None:
        raise UnsupportedConfigError(
            "vision_config/text_config: a multimodal checkpoint (its vision encoder's weights and "
            "activations are not modelled); describe the language model alone with ModelSpec fields")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfigError("use_bidirectional_attention: true is an encoder setting, not modelled")
    if cfg.get("attention_chunk_size"):
        raise UnsupportedConfigError("attention_chunk_size: chunked local attention (Llama 4) is not modelled")
    if cfg.get("first_k_dense_replace"):
        raise UnsupportedConfigError("first_k_dense_replace: dense layers before the MoE layers are not modelled")
    if (cfg.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedConfigError(
            f"decoder_sparse_step: {cfg['decoder_sparse_step']} (MoE every n-th layer) is not modelled; only 1")
    if cfg.get("mlp_only_layers"):
        raise UnsupportedConfigError("mlp_only_layers: dense layers among the MoE layers are not modelled")


def _rope(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling; a scaled rope extends the context as vLLM derives max_model_len."""
    out: dict[str, Any] = {}
    scaling = cfg.get("rope_scaling")
    nested = cfg.get("rope_parameters")   # transformers >= 5 nests rope_theta and the scaling here
    if isinstance(nested, dict):
        if "rope_theta" in nested:
            out["rope_theta"] = nested["rope_theta"]
        if "full_attention" in nested or "sliding_attention" in nested:   # per layer type (Gemma-3)
            nested = nested.get("full_attention") or {}
            out["rope_theta"] = nested.get("rope_theta", out.get("rope_theta"))
        scaling = {k: v for k, v in nested.items() if k != "rope_theta"} or None
    if not scaling:
        return out
    _check_rope_scaling(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {**out, "rope_scaling": None}
    if kind not in ("llama3", "yarn", "linear", "dynamic", "longrope"):
        raise UnsupportedConfigError(f"rope_scaling: type '{kind}' is not modelled "
                                     "(llama3, yarn, linear, dynamic, longrope)")
    out["rope_scaling"] = scaling
    # vLLM's max_model_len: yarn / linear / dynamic stretch the original context by `factor`;
    # llama3 and longrope configs already state the extended max_position_embeddings.
    if kind in ("yarn", "linear", "dynamic") and scaling.get("factor"):
        base = scaling.get("original_max_position_embeddings") if kind == "yarn" else None
        base = base or fields.get("max_position_embeddings", 4096)
        out["max_position_embeddings"] = max(int(base * scaling["factor"]),
                                             fields.get("max_position_embeddings", 0))
    return out


def _check_rope_scaling(scaling: Any) -> None:
    """A small mapping of settings whose numbers are finite and >= 0 (factor > 0): a negative
    factor or a 5,000-key mapping is a broken file, whatever its type says."""
    if not isinstance(scaling, dict):
        raise UnsupportedConfigError(f"rope_scaling is {excerpt(scaling)}, expected an object")
    if len(scaling) > MAX_ROPE_KEYS:
        raise UnsupportedConfigError(f"rope_scaling has {len(scaling):,} keys, at most {MAX_ROPE_KEYS} expected")
    try:
        check_bounded(scaling, "rope_scaling", max_depth=3, max_items=4096)
    except ValueError as e:
        raise UnsupportedConfigError(str(e)) from None
    for key, value in scaling.items():
        numbers = value if isinstance(value, list) else [value]
        for x in numbers:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                if isinstance(value, list) or not isinstance(x, (str, bool)):
                    raise UnsupportedConfigError(f"rope_scaling.{excerpt(key)} is {excerpt(value)}, expected "
                                                 f"a number, a list of numbers, a name or true/false")
            elif not math.isfinite(x) or x < 0 or (key == "factor" and x == 0):
                raise UnsupportedConfigError(f"rope_scaling.{excerpt(key)} is {excerpt(value)}, expected finite "
                                             f"numbers >= 0{' (> 0 for factor)' if key == 'factor' else ''}")


def _sliding_window(cfg: dict[str, Any], num_layers: int | None) -> dict[str, Any]:
    """Which layers attend to a window, as the HF model classes and vLLM decide it."""
    window = cfg.get("sliding_window") or cfg.get("sliding_window_size")
    layer_types = cfg.get("layer_types")
    if cfg.get("use_sliding_window") is False:     # Qwen2/3 carry a window they do not use
        if layer_types and "sliding_attention" in layer_types:
            raise UnsupportedConfigError("layer_types: sliding_attention layers with use_sliding_window: false")
        return {}
    if layer_types is not None:
        bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise UnsupportedConfigError(f"layer_types: '{bad[0]}' layers are not modelled "
                                         "(full_attention, sliding_attention)")
        if "sliding_attention" not in layer_types:
            return {}
        return {"sliding_window": window, "layer_types": list(layer_types)}
    if not window or num_layers is None:
        return {}
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        # Qwen2/3 with the window on: layers from max_window_layers up slide (HF's Qwen2 rule)
        first = cfg["max_window_layers"]
        return {"sliding_window": window,
                "layer_types": ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]}
    model_type = cfg.get("model_type")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if model_type == "gemma2":
        pattern = 2        # Gemma-2: even layers local, odd global
    if model_type in ("gemma3", "gemma3_text") and pattern is None:
        pattern = 6
    if pattern:
        # Gemma: every pattern-th layer (1-based) is global, the others local.
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
        return {"sliding_window": window, "layer_types": types}
    return {"sliding_window": window}     # Mistral v0.1: every layer slides


def _experts(cfg: dict[str, Any]) -> dict[str, Any]:
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    per_tok = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if not experts:
        if per_tok or shared or cfg.get("moe_intermediate_size") or cfg.get("n_shared_experts"):
            raise UnsupportedConfigError("num_experts_per_tok / moe_intermediate_size / shared experts are set "
                                         "but num_experts / num_local_experts is 0 or absent: a MoE model "
                                         "needs its expert count, a dense one none of these")
        return {}
    if not 1 <= per_tok <= experts:
        raise UnsupportedConfigError(f"num_experts_per_tok is {per_tok}, expected 1 to the {experts} experts")
    moe_inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if cfg.get("n_shared_experts"):
        shared = cfg["n_shared_experts"] * moe_inter
    return {"num_experts": experts, "num_experts_per_tok": per_tok, "moe_intermediate_size": moe_inter,
            "shared_expert_intermediate_size": shared}


# ----------------------------------------------------------------------------- quantization

def quantization_from_config(q: dict[str, Any]) -> WeightQuant:
    """A checkpoint's quantization_config -> WeightQuant, or a refusal naming the field."""
    if not isinstance(q, dict):
        raise UnsupportedConfigError(f"quantization_config: expected an object, got {q!r}")
    method = str(q.get("quant_method", "")).lower()
    readers = {"fp8": _fp8, "awq": _int4_awq, "gptq": _int4_gptq, "compressed-tensors": _compressed_tensors,
               "mxfp4": _mxfp4}
    if method not in readers:
        raise UnsupportedConfigError(
            f"quantization_config.quant_method: '{method}' is not modelled "
            f"(modelled: {', '.join(sorted(readers))}); its weight bytes and GEMM cost would be guessed")
    return readers[method](q)


def _fp8(q: dict[str, Any]) -> WeightQuant:
    _check_skipped(q.get("modules_to_not_convert") or q.get("ignored_layers"), "quantization_config.ignored_layers")
    block = q.get("weight_block_size")
    if block:
        return WeightQuant(method="fp8", scales="block", block=tuple(block))
    return WeightQuant(method="fp8", scales="tensor")


def _int4_awq(q: dict[str, Any]) -> WeightQuant:
    _check_bits(q.get("bits", q.get("w_bit")), 4, "quantization_config.bits")
    _check_skipped(q.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert")
    return WeightQuant(method="awq", scales="group", group_size=_group(q.get("group_size", q.get("q_group_size"))),
                       zero_point=bool(q.get("zero_point", True)))


def _int4_gptq(q: dict[str, Any]) -> WeightQuant:
    _check_bits(q.get("bits"), 4, "quantization_config.bits")
    _check_skipped(q.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert")
    group = q.get("group_size", 128)
    if group in (-1, None):
        return WeightQuant(method="gptq", scales="channel", zero_point=not q.get("sym", True))
    return WeightQuant(method="gptq", scales="group", group_size=_group(group),
                       zero_point=not q.get("sym", True), act_order=bool(q.get("desc_act", False)))


def _mxfp4(q: dict[str, Any]) -> WeightQuant:
    # gpt-oss: the experts are mxfp4, attention / router / embeddings stay bf16
    return WeightQuant(method="mxfp4", scales="group", group_size=32, experts_only=True)


def _compressed_tensors(q: dict[str, Any]) -> WeightQuant:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedConfigError(f"quantization_config.config_groups: {len(groups)} groups; "
                                     "only one scheme for all linear layers is modelled")
    scheme = next(iter(groups.values()))
    targets = scheme.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise UnsupportedConfigError(f"quantization_config.config_groups.targets: {targets}; only ['Linear'] is modelled")
    _check_skipped(q.get("ignore"), "quantization_config.ignore")
    w = scheme.get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "tensor")
    acts = scheme.get("input_activations")
    where = "quantization_config.config_groups.weights"
    if bits == 8:
        method = "fp8" if kind == "float" else "int8"
        scales = {"tensor": "tensor", "channel": "channel", "block": "block"}.get(strategy)
        if scales is None:
            raise UnsupportedConfigError(f"{where}.strategy: '{strategy}' for 8-bit weights is not modelled")
        block = tuple(w["block_structure"]) if scales == "block" else None
        return WeightQuant(method=method, scales=scales, block=block, quantized_activations=acts is not None)
    if bits == 4 and kind == "int":
        if acts is not None:
            raise UnsupportedConfigError(f"{where}: 4-bit weights with quantized activations (W4A8) are not modelled")
        zero = not w.get("symmetric", True)
        if strategy == "group":
            return WeightQuant(method="gptq", scales="group", group_size=_group(w.get("group_size")),
                               zero_point=zero, act_order=w.get("actorder") not in (None, False, "weight"))
        if strategy == "channel":
            return WeightQuant(method="gptq", scales="channel", zero_point=zero)
        raise UnsupportedConfigError(f"{where}.strategy: '{strategy}' for 4-bit weights is not modelled")
    raise UnsupportedConfigError(f"{where}: {bits}-bit {kind} weights are not modelled (8-bit fp/int, 4-bit int)")


def _check_bits(bits: Any, want: int, where: str) -> None:
    if bits != want:
        raise UnsupportedConfigError(f"{where}: {bits} is not modelled (only {want})")


def _group(size: Any) -> int:
    if not isinstance(size, int) or size <= 0:
        raise UnsupportedConfigError(f"quantization_config.group_size: {size!r} is not a positive integer")
    return size


def _check_skipped(modules: Any, where: str) -> None:
    """Layers a checkpoint leaves unquantized: fine when they are ones we keep in 16 bits anyway."""
    for name in modules or []:
        text = str(name).lower().removeprefix("re:").rstrip("$")
        last = text.replace("\\.", ".").split(".")[-1]
        if not (any(part in text for part in _UNQUANTIZED_ANYWAY) or last in _UNQUANTIZED_LAST):
            raise UnsupportedConfigError(
                f"{where}: '{name}' stays unquantized; partly quantized decoders are not modelled")
