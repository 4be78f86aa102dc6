"""vLLM's engine generation (engine.vllm_engine: auto | v0 | v1, Scenario.engine_generation), pinned
against the released wheels' code (vllm 0.6.3.post1, 0.6.4 - 0.6.6, 0.7.0, 0.7.3, 0.8.0 - 0.8.5, 0.9.0 -
0.9.2, 0.10.0 - 0.10.2, 0.11.0 - 0.11.2 and 0.12.0 from PyPI; paths inside the `vllm` package)."""
from __future__ import annotations

import pytest

from sim.core.scheduler_config import SchedulerConfig
from sim.core.vllm_versions import engine_generation, generation_problem, reads_use_v1, v1_fallbacks
from sim.costmodel import CostModel, trained_profile
from sim.errors import ScenarioError
from sim.front_end import front_end_s
from sim.scenario import validate_scenario
from sim.trained import error_band
from sim.vllm.serve_flags import translate, use_v1_by_release


def scenario(device="l4", model="llama-3.1-8b", **engine):
    return validate_scenario({"model": model, "device": device, "engine": {"max_model_len": 4096, **engine}})


def test_the_generation_each_release_runs_by_vllm_use_v1():
    """envs.py: VLLM_USE_V1 appears in 0.6.4 with default "0" (absent from 0.6.3.post1; V1 is opt-in
    through 0.7.3) and defaults to "1" from 0.8.0; 0.11.0 keeps the variable but engine/llm_engine.py
    is V1's LLMEngine and entrypoints/openai/api_server.py asserts envs.VLLM_USE_V1 (V0 refused);
    0.11.1 and 0.12.0 have no VLLM_USE_V1 anywhere in the package."""
    assert [engine_generation(v) for v in ("0.6.3", "0.7.3", "0.8.0", "0.10.2", "0.11.0", None)] == \
        ["v0", "v0", "v1", "v1", "v1", "v1"]
    assert engine_generation("0.7.3", "v1") == "v1" and engine_generation("0.9", "v0") == "v0"
    assert [reads_use_v1(v) for v in ("0.6.3.post1", "0.6.4", "0.7.3", "0.10.1.1", "0.11.0", "0.11.1", "0.12.0")] \
        == [False, True, True, True, True, False, False]
    assert generation_problem("0.6.3", "v1") and generation_problem("0.6.4", "v1") is None
    assert generation_problem("0.10.2", "v0") is None and generation_problem("0.11.0", "v0")
    assert generation_problem("0.19", "auto") is None


def test_a_0_7_3_scenario_with_v1_prices_and_schedules_as_v1():
    """0.7.3 envs.py: VLLM_USE_V1=1 runs V1 (default "0": V0). A 0.7.3 scenario with vllm_engine v1
    takes V1's scheduler defaults (mixed steps, prefix caching, no watermark: engine/arg_utils.py
    _override_v1_engine_args) and the trained family's V1 entry, band and front end; auto is V0."""
    v1, auto = scenario(vllm_version="0.7.3", vllm_engine="v1"), scenario(vllm_version="0.7.3")
    assert (v1.engine_generation, auto.engine_generation) == ("v1", "v0")
    cfg = SchedulerConfig.from_scenario(v1)
    assert (cfg.step_composition, cfg.admission_watermark, v1.engine.prefix_caching) == ("mixed", 0.0, True)
    assert SchedulerConfig.from_scenario(auto).step_composition == "prefill_first"
    assert CostModel.for_scenario(v1).profile.fit == trained_profile("l4", "v1").fit
    assert CostModel.for_scenario(auto).profile.fit == trained_profile("l4", "v0").fit
    assert trained_profile("l4", "v1").fit != trained_profile("l4", "v0").fit
    assert error_band("trained", None, v1.engine_generation) == error_band("trained", None, "v1")
    assert front_end_s(v1) == front_end_s(scenario()) > 0 == front_end_s(auto)


def test_a_0_9_scenario_with_v0_prices_and_schedules_as_v0():
    """0.9.2 envs.py: VLLM_USE_V1=0 runs V0 (engine/arg_utils.py create_engine_config: try_v1 is False),
    whose defaults are _set_default_args_v0's: 256 sequences, chunked prefill only over 32K tokens
    (so a budget of max(max_model_len, 2048): 0.9.2 config.py SchedulerConfig), prefix caching off;
    V0's scheduler composes prefill-only or decode-only steps with a 1 % watermark (core/scheduler.py)."""
    v0, auto = scenario(vllm_version="0.9.2", vllm_engine="v0"), scenario(vllm_version="0.9.2")
    assert (v0.engine_generation, auto.engine_generation) == ("v0", "v1")
    cfg = SchedulerConfig.from_scenario(v0)
    assert (cfg.step_composition, cfg.admission_watermark, cfg.chunked_prefill) == ("prefill_first", 0.01, False)
    assert not v0.engine.prefix_caching and auto.engine.prefix_caching
    assert (v0.max_num_seqs, v0.max_num_batched_tokens) == (256, 4096)
    assert SchedulerConfig.from_scenario(auto).step_composition == "mixed"
    assert CostModel.for_scenario(v0).profile.fit == trained_profile("l4", "v0").fit
    assert error_band("trained", None, v0.engine_generation) == error_band("trained", None, "v0")
    assert front_end_s(v0) == 0 < front_end_s(auto)
    # a setting of the user's wins over V0's default; a long context turns V0's chunked prefill on
    assert scenario(vllm_version="0.9.2", vllm_engine="v0", prefix_caching=True).engine.prefix_caching
    long = scenario(vllm_version="0.9.2", vllm_engine="v0", max_model_len=65536)
    assert long.engine.chunked_prefill and long.engine.step_composition == "mixed"
    assert long.max_num_batched_tokens == 2048


def test_invalid_generations_are_refused_naming_the_field():
    """V1 before 0.6.4 (no VLLM_USE_V1: 0.6.3.post1 envs.py), V0 from 0.11.0 (api_server.py asserts
    VLLM_USE_V1 in 0.11.0; the variable is gone from 0.11.1); VLLM_USE_V1=1 with a feature V1 lacks
    raises (0.9.1 engine/arg_utils.py _raise_or_fallback: "VLLM_USE_V1=1 is not supported with
    --scheduling-policy"); V0 has no async scheduling (0.10.0 config.py sets V1's AsyncScheduler)."""
    for engine, match in (({"vllm_version": "0.6.3", "vllm_engine": "v1"}, "vllm_engine v1: vLLM 0.6.3 has no V1"),
                          ({"vllm_version": "0.11.0", "vllm_engine": "v0"}, "vllm_engine v0: vLLM 0.11.0 has no V0"),
                          ({"vllm_engine": "v0"}, "vllm_engine v0: vLLM 0.19 has no V0"),
                          ({"vllm_version": "0.9.1", "vllm_engine": "v1", "scheduling_policy": "priority"},
                           "engine.vllm_engine v1: vLLM 0.9.1 refuses VLLM_USE_V1=1 with --scheduling-policy"),
                          ({"vllm_version": "0.9", "vllm_engine": "v0", "async_scheduling": True},
                           "V0 engine has no async scheduling"),
                          ({"vllm_engine": "v2"}, "vllm_engine"),
                          # kvtwin models these on V1's engine only: named, not run on V0's scheduler
                          ({"vllm_version": "0.7.3", "lora": {}}, "engine.lora: modelled on vLLM's V1 engine only"),
                          ({"vllm_version": "0.8.0", "lora": {}}, "vLLM 0.8.0 falls back to V0 for LoRA"),
                          ({"vllm_version": "0.9", "vllm_engine": "v0", "speculative": {"method": "eagle", "num_speculative_tokens": 3}},
                           "engine.speculative: modelled on vLLM's V1 engine only")):
        with pytest.raises(ScenarioError, match=match):
            scenario(**engine)


def test_auto_falls_back_to_v0_where_the_oracle_does():
    """engine/arg_utils.py _is_v1_supported_oracle, VLLM_USE_V1 unset: a feature V1 lacks runs V0.
    --scheduling-policy in 0.8.0-0.9.1 (gone in 0.9.2); "Compute Capability < 8.0" in 0.8.0-0.10.1
    (gone in 0.10.2); --kv-cache-dtype for any value in 0.8.0-0.8.2, from 0.8.3 only off
    FlashAttention 3 (vllm_flash_attn/fa_utils.py flash_attn_supports_fp8: major 9) and from 0.10.0
    off Blackwell (platforms/cuda.py is_kv_cache_dtype_supported: capability 100); --dtype float32 in
    0.8.0-0.9.1; concurrent partial prefills in 0.8.0-0.11.0 (with --long-prefill-token-threshold up
    to 0.8.2); LoRA and pipeline parallel experimental in 0.8.0-0.8.2 (_warn_or_fallback), pp without
    ray refused in 0.8.3-0.8.5, without ray / mp / external_launcher in 0.9.0-0.9.1, with uni from
    0.9.2; speculative methods: ngram experimental in 0.8.0-0.8.2, ngram / eagle / eagle3
    experimental in 0.8.3-0.8.5, ngram / medusa / eagle / eagle3 / deepseek_mtp in 0.9.x, the
    others refused."""
    def features(version, **kw):
        return [f.split(" (")[0].split(" ")[0] for f, _ in v1_fallbacks(version, **kw)]

    assert features("0.9.1", scheduling_policy="priority") == ["--scheduling-policy"]
    assert features("0.9.2", scheduling_policy="priority") == []
    assert features("0.10.1", device="t4") == ["Compute"] and features("0.10.2", device="t4") == []
    assert features("0.8.2", kv_cache_dtype="fp8", device="h100-sxm") == ["--kv-cache-dtype"]
    assert features("0.8.3", kv_cache_dtype="fp8", device="h100-sxm") == []
    assert features("0.9.2", kv_cache_dtype="fp8", device="b200") == ["--kv-cache-dtype"]
    assert features("0.10.0", kv_cache_dtype="fp8", device="b200") == []
    assert features("0.10.2", kv_cache_dtype="fp8", device="a100-80g") == ["--kv-cache-dtype"]
    assert features("0.9.1", model_dtype="float32") == ["--dtype"] and features("0.9.2", model_dtype="float32") == []
    assert features("0.10.2", partial_prefills=2) == ["Concurrent"]
    assert features("0.8.2", long_prefill_threshold=512) == ["Concurrent"] and \
        features("0.8.3", long_prefill_threshold=512) == []
    assert v1_fallbacks("0.8.2", lora=True)[0][1] and not v1_fallbacks("0.8.3", lora=True)
    assert v1_fallbacks("0.8.0", pipeline_parallel=2)[0][1]
    assert not v1_fallbacks("0.8.3", pipeline_parallel=2, executor="mp")[0][1]
    assert features("0.9.0", pipeline_parallel=2) == ["pipeline"] and not features("0.9.0", pipeline_parallel=2,
                                                                                    executor="mp")
    assert features("0.9.2", pipeline_parallel=2) == [] and features("0.9.2", pipeline_parallel=2, executor="uni")
    assert v1_fallbacks("0.8.0", speculative_method="ngram")[0][1]
    assert not v1_fallbacks("0.8.0", speculative_method="eagle")[0][1]
    assert v1_fallbacks("0.8.5", speculative_method="eagle3")[0][1]
    assert not v1_fallbacks("0.9.0", speculative_method="eagle") and v1_fallbacks("0.9.0", speculative_method="draft_model")
    assert v1_fallbacks("0.7.3", scheduling_policy="priority") == [] == v1_fallbacks("0.12", partial_prefills=2)
    # through a scenario: auto follows the fallback, VLLM_USE_V1=1 runs an experimental feature on V1
    assert scenario(vllm_version="0.9.1", scheduling_policy="priority").engine_generation == "v0"
    assert scenario(device="t4", vllm_version="0.10.1").engine_generation == "v0"
    assert scenario(device="t4", vllm_version="0.10.2").engine_generation == "v1"
    pp = {"vllm_version": "0.8.0", "pipeline_parallel_size": 2}
    assert scenario(**pp).engine_generation == "v0" and scenario(**pp, vllm_engine="v1").engine_generation == "v1"
    with pytest.raises(ScenarioError, match="its fallback, V0, is gone"):
        scenario(vllm_version="0.11.0", max_num_partial_prefills=2)


def test_auto_keeps_every_default_release_as_it_was():
    """auto on releases without a fallback is the release's default generation: nothing moves for a
    scenario that does not set vllm_engine (the prediction contract)."""
    for version in ("0.8.0", "0.10.1.1", "0.11.0", "0.19", "0.21.0"):
        s = scenario(vllm_version=version)
        assert s.engine_generation == "v1" and s.engine.step_composition == "mixed" and s.engine.prefix_caching
    static = scenario(vllm_version="0.7.3", batching="static")      # not vLLM's engine: no V0 defaults
    assert static.engine_generation == "v0" and static.engine.step_composition == "mixed"


def test_from_vllm_maps_vllm_use_v1_by_release():
    """VLLM_USE_V1 set before the command lands in engine.vllm_engine (envs.py reads bool(int(value)),
    0.6.4-0.11.0); a release that does not read it (0.12.0 envs.py has no VLLM_USE_V1) keeps auto and
    says so; VLLM_USE_V1=0 on 0.11.0 is refused as vLLM refuses it (api_server.py asserts
    envs.VLLM_USE_V1). It is never listed as ignored or unknown."""
    def translated(command, version):
        t = translate(command, "l4")
        t.raw.setdefault("engine", {})["vllm_version"] = version
        use_v1_by_release(t)
        return t

    t = translated("VLLM_USE_V1=1 vllm serve llama-3.1-8b --max-model-len 4096", "0.7.3")
    assert t.raw["engine"]["vllm_engine"] == "v1" and not t.ignored and not t.unknown
    assert ("VLLM_USE_V1=1", "engine.vllm_engine", "v1") in t.mapped
    assert validate_scenario(t.raw).engine_generation == "v1"
    t = translated("env VLLM_USE_V1=0 vllm serve llama-3.1-8b --max-model-len 4096", "0.9.2")
    assert validate_scenario(t.raw).engine_generation == "v0"
    t = translated("VLLM_USE_V1=0 vllm serve llama-3.1-8b --max-model-len 4096", "0.12.0")
    assert "vllm_engine" not in t.raw["engine"] and ("VLLM_USE_V1=0", "engine.vllm_engine", None) in t.mapped
    assert any("vLLM 0.12.0 does not read it" in r for r in t.remarks) and not t.ignored and not t.unknown
    with pytest.raises(ScenarioError, match="vLLM 0.11.0 has no V0"):
        validate_scenario(translated("VLLM_USE_V1=0 vllm serve llama-3.1-8b", "0.11.0").raw)
    from sim.errors import UserError
    with pytest.raises(UserError, match="VLLM_USE_V1=true"):
        translate("VLLM_USE_V1=true vllm serve llama-3.1-8b", "l4")


def test_from_vllm_cli_writes_the_engine_generation(tmp_path):
    """The written file's header names the generation and why (vLLM 0.9.1 falls back to V0 for
    --scheduling-policy: engine/arg_utils.py _is_v1_supported_oracle)."""
    from sim.cli import main
    from sim.scenario import load_scenario

    out = tmp_path / "s.yaml"
    assert main(["from-vllm", "--device", "l4", "--vllm-version", "0.9.1", "--out", str(out), "--",
                 "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--scheduling-policy", "priority"]) == 0
    assert "# vLLM engine: V0 (vLLM 0.9.1 falls back to V0 for --scheduling-policy priority" in out.read_text()
    assert load_scenario(out).engine_generation == "v0"


def test_every_public_run_is_on_its_releases_default_engine():
    """validate/lodo.py keys a run's coefficients by its scenario's generation (Run.engine) and a table
    row by its deployment's release (deployment_engine): the two agree on every public run, and the
    rate runs' recorded engine (tests/data/vllm_public/rate_runs.yaml `engine`) says the same."""
    import yaml

    from validate import lodo

    runs = lodo.all_runs()[0]
    assert all(r.engine == lodo.deployment_engine(r.deployment) for r in runs)
    recorded = {e["id"]: e["deployment"].get("engine") for e in
                yaml.safe_load((lodo.PUBLIC / "rate_runs.yaml").read_text())["runs"]}
    assert all(r.engine == recorded[r.id].lower() for r in runs if recorded.get(r.id))
    assert {r.engine for r in runs} == {"v0", "v1"}
