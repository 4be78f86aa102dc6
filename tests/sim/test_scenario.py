"""Scenario schema: clear errors that name the path, the value and what is allowed."""
import json
from pathlib import Path

import pytest

from sim.scenario import (ScenarioError, apply_overrides, expand_variants, load_scenario,
                          validate_scenario)

BASE = {"model": "qwen2.5-0.5b", "device": "h100-sxm"}


def errors_of(raw):
    with pytest.raises(ScenarioError) as err:
        validate_scenario(raw)
    return str(err.value)


def test_minimal_scenario_takes_vllm_defaults():
    s = validate_scenario(BASE)
    assert s.engine.block_size == 16 and s.engine.batching == "continuous"
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (1024, 8192)   # >= 70 GiB, not A100
    small = validate_scenario({**BASE, "device": "a100-80g"})
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)
    assert s.max_model_len == 32768


def test_misspelt_key_names_full_path_and_closest_key():
    msg = errors_of({**BASE, "engine": {"blok_size": 32}})
    assert "engine.blok_size: unknown key; did you mean 'block_size'?" in msg


def test_misspelt_nested_workload_key():
    msg = errors_of({**BASE, "workload": {"arrival": {"proces": "poisson", "rate": 1}}})
    assert "workload.arrival.proces: unknown key; did you mean 'process'?" in msg


@pytest.mark.parametrize("patch, expected", [
    ({"engine": {"block_size": 0}}, "engine.block_size: Input should be greater than or equal to 1 (got 0)"),
    ({"workload": {"arrival": {"process": "poisson", "rate": -2}}}, "workload.arrival.rate: Input should be greater than 0 (got -2)"),
    ({"engine": {"batching": "dynamic"}}, "engine.batching: Input should be 'continuous' or 'static' (got 'dynamic')"),
    ({"engine": {"max_num_seqs": "many"}}, "engine.max_num_seqs: Input should be a valid integer"),
    ({"parallelism": {"tp": 3}}, "parallelism.tp: 3 does not divide the model's 14 attention heads"),
    ({"workload": {"arrival": {"process": "poisson"}}}, "workload.arrival: arrival process 'poisson' needs a rate"),
    ({"workload": {"prompt_len": {"dist": "uniform", "min": 10}}}, "workload.prompt_len: dist 'uniform' needs max"),
    ({"model": "qwen9"}, "model: unknown model 'qwen9'"),
])
def test_bad_values_name_path_value_and_allowed(patch, expected):
    assert expected in errors_of({**BASE, **patch})


@pytest.mark.parametrize("version, accepted, refused", [
    ("0.6.3", (8, 16, 32), (1, 64, 128)),
    ("0.7.3", (8, 16, 32, 64, 128), (1, 4, 24, 256)),
    ("0.8.4", (8, 128), (1, 256)),
    ("0.8.5", (1, 8, 128), (4, 256)),
    ("0.10.2", (1, 8, 16, 32, 64, 128), (2, 4, 24, 256)),
    ("0.11.0", (1, 128), (256,)),
    ("0.11.1", (1, 256), (4, 512)),
    ("0.17.1", (1, 256), (24, 512)),
    ("0.18.0", (1, 4, 24, 512), ()),
    ("0.19.0", (1, 4, 24, 1024), ())])
def test_block_size_is_one_vllm_serve_accepts_at_vllm_version(version, accepted, refused):
    """`vllm serve --block-size` takes argparse choices: `choices=[8, 16, 32]` (0.6.0-0.6.3) and
    `[8, 16, 32, 64, 128]` (0.6.4-0.8.4) in vllm/engine/arg_utils.py; from 0.8.5 the choices come
    from `BlockSize = Literal[1, 8, 16, 32, 64, 128]` (vllm/config.py 0.8.5-0.9.x,
    vllm/config/cache.py 0.10.x-0.11.0), with 256 from 0.11.1 (config/cache.py, to 0.17.1); 0.18.0's
    and 0.19.0's config/cache.py type `block_size: SkipValidation[int]`: any size (checked on each
    wheel). kvtwin's own modes (static batching, contiguous allocation) take any size."""
    for size in accepted:
        validate_scenario({**BASE, "engine": {"vllm_version": version, "block_size": size}})
    for size in refused:
        msg = errors_of({**BASE, "engine": {"vllm_version": version, "block_size": size}})
        assert f"engine.block_size: {size} is not a block size vLLM {version} accepts (--block-size: " in msg
        for mode in ({"batching": "static"}, {"allocation": "contiguous"}):
            validate_scenario({**BASE, "engine": {"vllm_version": version, "block_size": size, **mode}})
    assert "(--block-size: 8, 16, 32, 64, 128); any size >= 1 from vLLM 0.18" in errors_of(
        {**BASE, "engine": {"vllm_version": "0.7.3", "block_size": 4}})


def test_several_problems_are_all_reported():
    msg = errors_of({**BASE, "engine": {"block_size": 0, "prefix_cachin": True}})
    assert "2 problems" in msg and "engine.block_size" in msg and "engine.prefix_cachin" in msg


def test_length_shorthand_int_means_fixed():
    s = validate_scenario({**BASE, "workload": {"prompt_len": 35, "output_len": 1}})
    assert (s.workload.prompt_len.dist, s.workload.prompt_len.value) == ("fixed", 35)


def test_explicit_model_shape_and_device_overrides():
    shape = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=100, dtype="float16")
    s = validate_scenario({"model": shape, "device": {"base": "l4", "memory_mib": 12000}})
    assert s.model.num_layers == 2 and s.device.memory_mib == 12000 and s.device.bf16_tflops == 121.0


def test_hf_config_json_is_a_model(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
           "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
           "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1e6,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "s.yaml").write_text("model: {hf_config: config.json}\ndevice: h200\n")
    s = load_scenario(tmp_path / "s.yaml")
    assert s.model.architecture == "qwen2" and s.model.head_dim == 64 and s.model.qkv_bias


def test_overrides_use_the_same_validation(tmp_path):
    (tmp_path / "s.yaml").write_text("model: qwen2.5-0.5b\ndevice: h200\n")
    s = load_scenario(tmp_path / "s.yaml", ["engine.block_size=32", "model.dtype=float16"])
    assert s.engine.block_size == 32 and s.model.dtype == "float16" and s.model.num_layers == 24
    with pytest.raises(ScenarioError, match="engine.blok_size: unknown key; did you mean 'block_size'"):
        load_scenario(tmp_path / "s.yaml", ["engine.blok_size=32"])
    with pytest.raises(ScenarioError, match=r"engine.block_size: .*greater than or equal to 1 \(got 0\)"):
        load_scenario(tmp_path / "s.yaml", ["engine.block_size=0"])
    with pytest.raises(ScenarioError, match="expected PATH=VALUE"):
        apply_overrides({}, ["engine.block_size"])


def test_relative_paths_resolve_against_the_scenario_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "s.yaml").write_text(
        "model: tiny\ndevice: cpu\nworkload:\n  trace: {format: azure, path: ../data/t.csv}\n")
    s = load_scenario(tmp_path / "sub" / "s.yaml")
    assert s.workload.trace.path == (tmp_path / "sub" / ".." / "data" / "t.csv").resolve() or \
        s.workload.trace.path.resolve() == (tmp_path / "data" / "t.csv").resolve()


def test_relative_paths_given_with_set_resolve_against_the_working_folder(tmp_path, monkeypatch):
    """What a CLI user types is relative to where they typed it: `--set device.profile=p.yaml` from
    the folder holding p.yaml, whatever folder the scenario file is in. A path in the file stays the
    file's; an absolute one is kept; the same rule holds at the field and inside a section set whole."""
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "scenarios" / "s.yaml").write_text(
        "model: tiny\ndevice: cpu\nworkload:\n  trace: {format: azure, path: in_file.csv}\n")
    monkeypatch.chdir(tmp_path / "work")
    s = load_scenario(tmp_path / "scenarios" / "s.yaml")
    assert s.workload.trace.path == tmp_path / "scenarios" / "in_file.csv"
    s = load_scenario(tmp_path / "scenarios" / "s.yaml", ["workload.trace.path=typed.csv"])
    assert s.workload.trace.path == tmp_path / "work" / "typed.csv"
    s = load_scenario(tmp_path / "scenarios" / "s.yaml", ["workload.trace={format: azure, path: sub/t.csv}"])
    assert s.workload.trace.path == tmp_path / "work" / "sub" / "t.csv"
    s = load_scenario(tmp_path / "scenarios" / "s.yaml", [f"workload.trace.path={tmp_path / 'abs.csv'}"])
    assert s.workload.trace.path == tmp_path / "abs.csv"
    s = load_scenario(tmp_path / "scenarios" / "s.yaml", ["device=h100-sxm", "device.profile=p.yaml"])
    assert Path(s.device.profile) == tmp_path / "work" / "p.yaml"           # not scenarios/p.yaml


def test_yaml_syntax_error_names_the_line(tmp_path):
    (tmp_path / "s.yaml").write_text("model: tiny\ndevice: [cpu\n")
    with pytest.raises(ScenarioError, match=r"line \d+, column \d+"):
        load_scenario(tmp_path / "s.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    (tmp_path / "s.yaml").write_text("model: !!python/object/apply:os.system ['echo hi']\ndevice: cpu\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(tmp_path / "s.yaml")


def test_variants_merge_over_the_base_and_validate_with_their_path():
    s = validate_scenario({**BASE, "variants": {
        "static": {"engine": {"batching": "static", "allocation": "contiguous"}},
        "continuous": {}}})
    runs = expand_variants(s)
    assert runs["static"].engine.allocation == "contiguous" and runs["continuous"].engine.allocation == "paged"
    bad = validate_scenario({**BASE, "variants": {"x": {"engine": {"blok_size": 1}}}})
    with pytest.raises(ScenarioError, match="variants.x.engine.blok_size: unknown key"):
        expand_variants(bad)


def test_a_variant_error_names_the_scenario_file(tmp_path, capsys):
    # it printed "error: variants.x.engine.blok_size: unknown key ..." and no file
    from sim.cli import main

    path = tmp_path / "s.yaml"
    path.write_text("model: tiny\ndevice: cpu\nworkload: {num_requests: 2, prompt_len: 8, output_len: 2}\n"
                    "variants: {x: {engine: {blok_size: 1}}}\n")
    assert main([str(path), "--out", str(tmp_path / "o"), "--quiet", "--no-plots"]) == 2
    assert f"error: {path}: variants.x.engine.blok_size: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_shipped_scenario_round_trips_through_its_manifest_dump(path):
    """A manifest stores the resolved scenario; loading it back must give the same scenario."""
    scenario = load_scenario(path)
    for variant in expand_variants(scenario, path.parent).values():
        again = validate_scenario(variant.model_dump(mode="json"))
        assert again.model_dump() == variant.model_dump()
