"""Scenario YAML and bounds: alias bombs and recursive aliases, duplicate keys, finite floats,
upper bounds on sizes, booleans and 5,000-digit integers, arrival processes that cannot advance."""
from __future__ import annotations

from pathlib import Path

import pytest

from sim.cli import main
from sim.scenario import ScenarioError, validate_scenario

from support import alarm as within, BASE, run_cli, SMALL


ALIAS_BOMB = """model:
  base: qwen2.5-0.5b
  rope_scaling:
    a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
device: h100-sxm
"""


def load_text(tmp_path, text: str, name: str = "s.yaml", overrides=None):
    from sim.scenario import load_scenario

    path = tmp_path / name
    path.write_text(text)
    return load_scenario(path, overrides)


def test_alias_bomb_fails_fast_with_a_clean_error(tmp_path):
    import time

    t0 = time.process_time()
    with pytest.raises(ScenarioError, match=r"s\.yaml:\d+: expands to more than"):
        load_text(tmp_path, ALIAS_BOMB)
    assert time.process_time() - t0 < 2.0


def test_rope_scaling_given_as_python_data_is_bounded_too():
    shared = ["x"] * 10
    for _ in range(6):
        shared = [shared] * 10      # a billion leaves by reference, a few kB in memory
    with pytest.raises(ScenarioError, match="rope_scaling"):
        validate_scenario({**BASE, "model": {"base": "qwen2.5-0.5b", "rope_scaling": {"a": shared}}})


def test_duplicate_keys_are_errors_with_both_lines(tmp_path):
    text = "model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 1024}\nworkload: {num_requests: 3}\nengine:\n  block_size: 8\n"
    with pytest.raises(ScenarioError, match=r"s\.yaml: line 5, column 1: not valid YAML \(duplicate key 'engine' \(first at line 3\)"):
        load_text(tmp_path, text)
    nested = "model: qwen2.5-0.5b\ndevice: h100-sxm\nengine:\n  block_size: 8\n  block_size: 16\n"
    with pytest.raises(ScenarioError, match=r"line 5.*duplicate key 'block_size' \(first at line 4\)"):
        load_text(tmp_path, nested)


def test_yaml_merge_keys_still_override():
    from sim.core.files import load_yaml

    assert load_yaml("base: &b {x: 1, y: 2}\nnew:\n  <<: *b\n  y: 3\n")["new"] == {"x": 1, "y": 3}


INFINITE = ["workload.arrival.rate=.inf", "workload.duration_s=.inf", "engine.gpu_memory_utilization=.nan",
            "slo.ttft_s=.inf", "device.memory_mib=.inf", "model.rope_theta=.inf", "cluster.load_bound=.inf",
            "workload.prompt_len={dist: normal, mean: .inf, std: 1}", "workload.arrival.cv=.nan",
            "engine.activation_mib=-.inf", "device.hbm_gbps=.inf"]


@pytest.mark.parametrize("override", INFINITE)
def test_every_float_field_is_finite(tmp_path, override):
    with pytest.raises(ScenarioError, match="finite number"):
        load_text(tmp_path, SMALL, overrides=[override])


TOO_BIG = {"cluster.replicas=1000000": "cluster.replicas", "cluster.replicas=1000": "blocks, more than the",
           "workload.num_requests=1e12": "workload.num_requests",
           "workload.num_requests=1000000000000": "workload.num_requests",
           "engine.num_blocks=1000000000000": "engine.num_blocks", "engine.num_blocks=10000000": "GiB of KV cache",
           "device.memory_mib=1e30": "device.memory_mib", "workload.duration_s=1e9": "workload.duration_s",
           "engine.max_model_len=1000000000": "engine.max_model_len",
           "workload.output_len=1000000000": "workload.output_len"}


@pytest.mark.parametrize("override", list(TOO_BIG), ids=list(TOO_BIG))
def test_sizes_have_upper_bounds(tmp_path, override):
    with pytest.raises(ScenarioError, match=TOO_BIG[override].replace(".", r"\.")):
        # pool sizes derived from the device's memory (an H100: ~375k blocks per replica)
        load_text(tmp_path, SMALL.replace("engine: {num_blocks: 256, max_model_len: 256}\n", ""),
                  overrides=[override])


def test_rate_times_duration_is_bounded(tmp_path):
    with pytest.raises(ScenarioError, match="rate x duration_s"):
        load_text(tmp_path, "model: qwen2.5-0.5b\ndevice: h100-sxm\n"
                  "workload: {duration_s: 100000, arrival: {process: poisson, rate: 100}}\n")


def test_set_mapping_merges_into_the_section(tmp_path):
    text = "model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 1024, block_size: 32}\n"
    s = load_text(tmp_path, text, overrides=["engine={block_size: 8}"])
    assert s.engine.block_size == 8 and s.engine.max_model_len == 1024
    s = load_text(tmp_path, text, overrides=["model={max_position_embeddings: 8192}"])
    assert s.model.max_position_embeddings == 8192 and s.model.num_layers == 24
    assert load_text(tmp_path, text + "variants: {a: {}}\n", overrides=["variants={}"]).variants == {}


@pytest.mark.parametrize("arrival, message", [
    ("{process: poisson, rate: 2.5e-320}", "30 days"),
    ("{process: gamma, rate: 10, cv: 99}", "all at t=0"),
])
def test_arrival_processes_that_would_give_nan_times_are_errors(tmp_path, arrival, message):
    from sim.workload import build_workload

    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("num_requests: 4", f"num_requests: 4, arrival: {arrival}"))
    with pytest.raises(ValueError, match=message):
        from sim.scenario import load_scenario

        build_workload(load_scenario(path))


def test_a_duration_bounded_gamma_process_that_cannot_advance_is_an_error_not_a_hang(tmp_path):
    from sim.scenario import load_scenario
    from sim.workload import build_workload

    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\n"
                    "workload: {duration_s: 10, arrival: {process: gamma, rate: 1, cv: 99}}\n")
    with pytest.raises(ValueError, match="all at t=0"):
        build_workload(load_scenario(path))


RECURSIVE_ALIASES = {
    "a list holding itself": "foo: &a [*a]\n",
    "a section holding itself": "engine: &e\n  block_size: 16\n  self: *e\n",
    "two levels down": "x: &a {b: [1, {c: *a}]}\n",
    "through a merge key": "x: &a {<<: *a}\n",
}


@pytest.mark.parametrize("text", RECURSIVE_ALIASES.values(), ids=RECURSIVE_ALIASES.keys())
def test_a_recursive_yaml_alias_is_refused_at_load_time(text, tmp_path):
    from sim.core.files import FileFormatError, load_yaml, read_yaml

    with within(10), pytest.raises(FileFormatError, match=r"s\.yaml:\d+: a recursive alias"):
        load_yaml(text, "s.yaml")
    (tmp_path / "p.yaml").write_text(text)
    with within(10), pytest.raises(FileFormatError, match=r"p\.yaml:\d+: a recursive alias"):
        read_yaml(tmp_path / "p.yaml")        # profiles, --config files


def test_shared_aliases_that_do_not_recurse_still_load():
    from sim.core.files import load_yaml

    assert load_yaml("a: &x [1, 2]\nb: [*x, {c: *x}]\n") == {"a": [1, 2], "b": [[1, 2], {"c": [1, 2]}]}


def test_recursive_aliases_in_a_scenario_and_in_set_are_clean_errors(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL + "foo: &a [*a]\n")
    with within(20):
        code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{scenario}:5: a recursive alias" in err and "Traceback" not in err
    scenario.write_text(SMALL)
    with within(20):
        code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", "engine.block_size=&a [*a]"], capsys)
    assert code == 2 and "--set engine.block_size:1: a recursive alias" in err


def test_a_control_character_in_a_scenario_or_a_set_is_a_clean_error(tmp_path, capsys):
    """PyYAML's reader refuses control characters while the loader is built, before the parse: a
    bell in a scenario or an escape in a --set value raised ReaderError with a traceback (found by
    h/audit2). The error names the line and shows the character escaped, never raw."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL + "name: a\x07b\n")
    code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"{scenario}:5: " in err and "'\\x07'" in err and "\x07" not in err, err
    scenario.write_text(SMALL)
    for argv in (["--set", "name=b\x1b[31m"], ["--set", "name=a,b\x1b[31m"]):
        code, err = run_cli([scenario, "--out", tmp_path / "o", *argv], capsys)
        assert code == 2 and "--set name:1: " in err and "'\\x1b'" in err and "\x1b" not in err, err


def test_twenty_thousand_unknown_keys_print_a_short_error(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(SMALL + "".join(f"unknown_{i}: 1\n" for i in range(20_000)))
    code, err = run_cli([path, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "20000 problems" in err and "... and 19,988 more" in err and len(err) < 3000


@pytest.mark.parametrize("field", ["engine.block_size", "workload.num_requests", "seed", "engine.num_blocks",
                                   "engine.gpu_memory_utilization", "model.hidden_size", "cluster.replicas"])
def test_a_boolean_is_not_a_number_in_a_scenario(tmp_path, field):
    section, _, key = field.rpartition(".")
    with pytest.raises(ScenarioError, match=rf"{section or 'top level'}: {key}: true is a boolean, expected a number"):
        load_text(tmp_path, SMALL.replace("model: qwen2.5-0.5b", "model: {base: qwen2.5-0.5b}"), overrides=[f"{field}=true"])


@pytest.mark.parametrize("field, value, where", [
    ("workload.prompt_len", "{dist: empirical, values: [100, true]}", r"workload.prompt_len: values\[1\]"),
    ("workload.priorities", "{values: [0, 1], weights: [1, false]}", r"workload.priorities: weights\[1\]"),
    ("engine.speculative", "{method: eagle, num_speculative_tokens: 2, acceptance_rates: [0.7, true]}",
     r"engine.speculative: acceptance_rates\[1\]"),
])
def test_a_boolean_is_not_a_number_in_a_list_of_numbers(tmp_path, field, value, where):
    # pydantic reads `true` in a list[int] as 1: an empirical length of one token, a weight of 1
    with pytest.raises(ScenarioError, match=rf"{where}: (true|false) is a boolean, expected a number"):
        load_text(tmp_path, SMALL, overrides=[f"{field}={value}"])


def test_a_problem_a_set_wrote_says_so_and_one_from_the_file_does_not(tmp_path, capsys):
    # the error named only the file, which holds no engine.blok_size to find
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL)
    code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", "engine.blok_size=32"], capsys)
    assert code == 2 and f"{scenario}: engine.blok_size: unknown key" in err
    assert err.rstrip().endswith("(given by --set engine.blok_size)"), err
    code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", "engine.max_num_seqs=true"], capsys)
    assert code == 2 and "max_num_seqs: true is a boolean, expected a number (given by --set engine.max_num_seqs)" in err
    scenario.write_text(SMALL.replace("num_blocks: 256", "num_blocks: 256, max_num_seqs: true"))
    code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", "engine.block_size=32"], capsys)
    assert code == 2 and "max_num_seqs: true is a boolean" in err and "given by --set" not in err, err


def test_a_fixed_pool_beside_weights_that_cannot_fit_is_refused_as_without_it(tmp_path, capsys):
    from sim.core.memory import InsufficientMemoryError, plan_memory

    with pytest.raises(InsufficientMemoryError):         # without num_blocks: the plan refuses it
        plan_memory(validate_scenario({"model": "llama-3.1-70b", "device": "l4"}))
    with pytest.raises(ScenarioError, match=r"engine.num_blocks: 256 blocks .* with 131.4 GiB of weights per GPU "
                                            r"is more than the device's 22.49 GiB; the weights alone do not fit"):
        validate_scenario({"model": "llama-3.1-70b", "device": "l4", "engine": {"num_blocks": 256}})
    validate_scenario({"model": "llama-3.1-8b", "device": "l4", "engine": {"num_blocks": 256}})   # 15 GiB fits


def test_a_5000_digit_integer_names_the_file_line_or_set_path(tmp_path, capsys):
    huge = "9" * 5000
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"seed: {huge}\n" + SMALL)
    code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{scenario}:1: an integer of 5,000 digits" in err and "set_int_max_str_digits" not in err
    scenario.write_text(SMALL)
    code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", f"seed={huge}"], capsys)
    assert code == 2 and "--set seed:1: an integer of 5,000 digits" in err and len(err) < 300
    with pytest.raises(SystemExit) as exit_:
        main([str(scenario), "--seed", huge])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --seed: '9999" in err and len(err) < 1000


def test_the_package_yaml_loader_reads_what_safe_load_reads():
    """The catalog and the trained family are read with libyaml's safe loader (start-up time);
    each bundled file must come out exactly as yaml.safe_load gives it."""
    import yaml

    from sim.core.files import load_package_yaml

    catalog = Path(__file__).resolve().parents[2] / "sim" / "core" / "catalog"
    files = sorted(catalog.glob("*.yaml"))
    assert {f.name for f in files} >= {"devices.yaml", "models.yaml", "trained-v1.yaml"}
    for f in files:
        text = f.read_text()
        assert load_package_yaml(text) == yaml.safe_load(text), f.name
