"""Weights: seeded random init, and loading checkpoints the tests write in HF's layout."""
import json

import pytest
import torch
from safetensors.torch import save_file

from engine.weights import (WeightsError, build_model, checkpoint_names, init_random_weights,
                            spec_from_hf_folder)
from sim.core.catalog import ModelSpec, get_model


HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=128, dtype="float32")
SPECS = {
    "qwen2-tied": get_model("tiny"),
    "llama-untied": ModelSpec(architecture="llama", tie_word_embeddings=False, **SMALL),
    "qwen3": ModelSpec(architecture="qwen3", tie_word_embeddings=True, **SMALL),
}


def hf_config(spec: ModelSpec) -> dict:
    return {"architectures": [HF_ARCH[spec.architecture]], "num_hidden_layers": spec.num_layers,
            "hidden_size": spec.hidden_size, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.max_position_embeddings, "rope_theta": spec.rope_theta,
            "rms_norm_eps": spec.rms_norm_eps, "tie_word_embeddings": spec.tie_word_embeddings,
            "torch_dtype": spec.dtype}


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under HF's names, q/k/v and gate/up split apart again."""
    params = dict(model.named_parameters())
    return {name: (params[ours] if rows is None else params[ours][rows]).clone()
            for name, (ours, rows) in checkpoint_names(model.spec).items()}


def write_checkpoint(folder, spec: ModelSpec, tensors: dict, shards: int = 1, config: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or hf_config(spec)))
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
        return folder
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, folder / file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def source_model(spec: ModelSpec, seed: int = 1):
    return build_model(spec, "cpu", seed=seed)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_checkpoint_round_trips(tmp_path, name, shards):
    spec = SPECS[name]
    src = source_model(spec)
    folder = write_checkpoint(tmp_path / "ckpt", spec, hf_tensors(src), shards)
    loaded = build_model(spec.model_copy(update={"weights": folder}), "cpu", seed=2)
    for (n, a), (_, b) in zip(src.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n


def test_spec_from_hf_folder_reads_the_checkpoint_shape(tmp_path):
    spec = SPECS["llama-untied"]
    folder = write_checkpoint(tmp_path, spec, hf_tensors(source_model(spec)))
    assert spec_from_hf_folder(folder) == spec.model_copy(update={"weights": folder, "name": folder.name})


def test_transformers_5_rope_parameters(tmp_path):
    spec = SPECS["llama-untied"]
    config = hf_config(spec)
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
    folder = write_checkpoint(tmp_path, spec, {}, config=config)
    read = spec_from_hf_folder(folder)
    assert read.rope_theta == 500000.0
    assert read.rope_scaling == {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    spec = SPECS["qwen2-tied"]
    tensors = hf_tensors(source_model(spec))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    build_model(spec.model_copy(update={"weights": write_checkpoint(tmp_path, spec, tensors)}), "cpu")


def broken(tmp_path, edit, shards: int = 1, config: dict | None = None):
    spec = SPECS["qwen2-tied"]
    tensors = hf_tensors(source_model(spec))
    edit(tensors)
    folder = write_checkpoint(tmp_path / "ckpt", spec, tensors, shards, config)
    return spec.model_copy(update={"weights": folder})


def test_missing_tensor_is_named(tmp_path):
    spec = broken(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), shards=2)
    with pytest.raises(WeightsError,
                       match=r"lacks 1 tensor.*'model.layers.1.mlp.up_proj.weight' \(shape \[256, 128\]\)"):
        build_model(spec, "cpu")


def test_wrong_shape_is_named_with_both_shapes(tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(32)
    with pytest.raises(WeightsError, match=r"'model.layers.0.self_attn.k_proj.bias' has shape \[32\], "
                                           r"the model spec needs \[64\]"):
        build_model(broken(tmp_path, shrink), "cpu")


def test_unexpected_tensor_is_named(tmp_path):
    spec = broken(tmp_path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightsError, match="no place for, first 'model.layers.0.mlp.extra.weight'"):
        build_model(spec, "cpu")


def test_config_of_another_model_is_refused(tmp_path):
    config = hf_config(SPECS["qwen2-tied"]) | {"num_attention_heads": 8, "rope_theta": 1e6}
    with pytest.raises(WeightsError, match=r"num_heads: config.json has 8, the model spec 4; rope_theta"):
        build_model(broken(tmp_path, lambda t: None, config=config), "cpu")


def test_index_naming_an_absent_shard(tmp_path):
    spec = broken(tmp_path, lambda t: None, shards=2)
    (spec.weights / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="names shard model-00002-of-00002.safetensors"):
        build_model(spec, "cpu")


def test_absent_folder_is_never_downloaded(tmp_path):
    spec = get_model("tiny").model_copy(update={"weights": tmp_path / "nowhere"})
    with pytest.raises(WeightsError, match="nowhere"):
        build_model(spec, "cpu")


def test_random_weights_are_seeded_at_hf_scale():
    spec = SPECS["llama-untied"]
    a, b, c = source_model(spec, 0), source_model(spec, 0), source_model(spec, 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1), name
        else:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - 0.02) < 0.003, name
    init_random_weights(a, seed=0, std=0.1)
    assert abs(a.lm_head.std().item() - 0.1) < 0.01
