"""`simrun from-vllm`: vLLM serve flags -> scenario fields, every other flag accounted for."""
from __future__ import annotations

import pytest
import yaml

from sim.cli import main
from sim.errors import UserError
from sim.scenario import load_scenario
from sim.vllm.serve_flags import IGNORED, MODELLED, flag_table_markdown, split_flags, translate


def test_modelled_flags_land_in_their_fields():
    t = translate("vllm serve Qwen/Qwen2.5-7B-Instruct --max-num-seqs 64 --max_model_len=8K "
                  "--gpu-memory-utilization 0.85 --block-size 32 --max-num-batched-tokens 4096 "
                  "--num-gpu-blocks-override 5000 --no-enable-prefix-caching -tp 2 "
                  "--scheduling-policy priority --dtype half", "h100-sxm")
    raw = t.raw
    assert raw["model"] == {"base": "qwen2.5-7b", "dtype": "float16"}
    assert raw["engine"] == {"max_num_seqs": 64, "max_model_len": 8192, "gpu_memory_utilization": 0.85,
                             "block_size": 32, "max_num_batched_tokens": 4096, "num_blocks": 5000,
                             "prefix_caching": False, "scheduling_policy": "priority"}
    assert raw["parallelism"] == {"tp": 2}
    assert not t.ignored and not t.unknown


def test_quantization_kv_dtype_and_parallel_flags():
    t = translate("vllm serve qwen3-30b-a3b -tp 2 -dp 4 --enable-expert-parallel --kv-cache-dtype fp8 "
                  "--quantization fp8", "h100-sxm")
    assert t.raw["parallelism"] == {"tp": 2, "dp": 4, "ep": 8}
    assert t.raw["engine"] == {"kv_cache_dtype": "fp8"}
    assert t.raw["model"] == {"base": "qwen3-30b-a3b", "quantization": {"method": "fp8", "scales": "tensor"}}
    with pytest.raises(UserError, match="--quantization bitsandbytes: 'bitsandbytes' is not a method"):
        translate("vllm serve tiny --quantization bitsandbytes", "cpu")


def test_data_parallel_flags_are_mapped_as_vllm_resolves_them():
    """vLLM 0.19 engine/arg_utils.py: -dpl / --data-parallel-size-local, -dph / --data-parallel-
    hybrid-lb, -dpe / --data-parallel-external-lb, -dpn / --data-parallel-rank (implies external
    balancing), -dpr / --data-parallel-start-rank (implies hybrid), -dpb / --data-parallel-backend,
    -ep, --all2all-backend; entrypoints/openai/cli_args.py: -asc / --api-server-count. Each lands
    in a parallelism field (sim/dp.py reads them); none is ignored."""
    t = translate("vllm serve qwen3-30b-a3b -dp 4 -dpl 2 -dph -ep --all2all-backend deepep_low_latency "
                  "-asc 3 -dpb ray", "h100-sxm")
    assert t.raw["parallelism"] == {"dp": 4, "ep": 4, "dp_local": 2, "dp_load_balancing": "hybrid",
                                    "all2all_backend": "deepep_low_latency", "api_servers": 3, "dp_backend": "ray"}
    assert not t.ignored and not t.unknown
    for flags, mode in (("--data-parallel-external-lb", "external"), ("-dpn 1", "external"),
                        ("--data-parallel-start-rank 2 -dpl 2", "hybrid"), ("--no-data-parallel-hybrid-lb", "internal"),
                        ("--data-parallel-hybrid-lb false", "internal")):
        assert translate(f"vllm serve qwen3-30b-a3b -dp 4 {flags}", "h100-sxm").raw["parallelism"][
            "dp_load_balancing"] == mode, flags
    with pytest.raises(UserError, match="--all2all-backend nccl: 'nccl' is not one of"):
        translate("vllm serve qwen3-30b-a3b -dp 2 --all2all-backend nccl", "h100-sxm")


def test_other_flags_are_listed_never_dropped():
    t = translate(["vllm", "serve", "tiny", "--host", "0.0.0.0", "--trust-remote-code", "--port", "9",
                   "--brand-new-flag", "x", "--disable-log-stats", "--max-num-seqs", "4"], "cpu")
    assert [f for f, _, _ in t.ignored] == ["--host", "--trust-remote-code", "--port", "--disable-log-stats"]
    assert t.unknown == [("--brand-new-flag", "x")]
    assert t.raw["engine"] == {"max_num_seqs": 4}      # a switch did not swallow the next flag
    assert any("--brand-new-flag" in n for n in t.notes())


def test_boolean_forms_and_explicit_values():
    assert translate("vllm serve tiny --enable-chunked-prefill false", "cpu").raw["engine"] == {"chunked_prefill": False}
    assert translate("vllm serve tiny --enable-prefix-caching", "cpu").raw["engine"] == {"prefix_caching": True}
    positional, flags = split_flags(["tiny", "--enable-prefix-caching", "--max-num-seqs", "3", "-O3"])
    assert positional == ["tiny"] and flags == [("--enable-prefix-caching", None), ("--max-num-seqs", "3"),
                                                ("-O", "3")]


def test_misspelt_modelled_flag_is_an_error():
    with pytest.raises(UserError, match="did you mean --max-num-seqs"):
        translate("vllm serve tiny --max-num-seq 8", "cpu")


def test_bad_values_and_models_are_named():
    with pytest.raises(UserError, match="--max-num-seqs lots"):
        translate("vllm serve tiny --max-num-seqs lots", "cpu")
    with pytest.raises(UserError, match="did you mean qwen/qwen2.5-7b-instruct"):
        translate("vllm serve Qwen/Qwen2.5-7B-Instruc", "cpu")
    with pytest.raises(UserError, match="unexpected word"):
        translate("vllm serve tiny extra --max-num-seqs 2", "cpu")


def test_config_file_and_local_folder(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, '
        '"num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}')
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-num-seqs: 16\nenable-prefix-caching: false\nhost: 0.0.0.0\n")
    t = translate(f"vllm serve {folder} --config {cfg} --max-num-seqs 8", "cpu")
    assert t.raw["model"] == {"hf_config": str(folder.resolve())}
    assert t.raw["engine"] == {"max_num_seqs": 8, "prefix_caching": False}   # the command line wins
    assert [f for f, _, _ in t.ignored] == ["--host"]


def test_cli_writes_a_loadable_scenario(tmp_path, capsys):
    out = tmp_path / "s.yaml"
    rc = main(["from-vllm", "--device", "h100-sxm", "--out", str(out), "--",
               "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "32", "--api-key", "k"])
    assert rc == 0
    text = out.read_text()
    assert "--api-key REDACTED: ignored" in text        # a secret is not written (without_secrets)
    scenario = load_scenario(out)
    assert scenario.model.name == "llama-3.1-8b" and scenario.max_num_seqs == 32
    assert main(["from-vllm", "--device", "h100-sxm", "--strict", "vllm serve tiny --new-thing"]) == 2
    assert "--new-thing" in capsys.readouterr().err


def test_docs_table_lists_every_modelled_flag():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "live_endpoints.md").read_text()
    assert flag_table_markdown() in page, "docs/live_endpoints.md's from-vllm table is out of date: paste flag_table_markdown()"
    assert len(MODELLED) == flag_table_markdown().count("\n") - 1


def test_version_timing_and_memory_flags_are_mapped_not_ignored():
    """The flags behind vLLM's timing and memory by version land in scenario fields: vLLM 0.19
    engine/arg_utils.py names them (--enforce-eager, --kv-cache-memory-bytes, --distributed-executor-
    backend, --speculative-config / -sc, --long-prefill-token-threshold, --max-num-partial-prefills);
    config/speculative.py infers an unset method (ngram, eagle- / eagle3 in the draft's name, else
    draft_model) and renames the *_mtp methods mtp."""
    t = translate("vllm serve tiny --enforce-eager --kv-cache-memory-bytes 20G --distributed-executor-backend ray "
                  "--long-prefill-token-threshold 1k --max-num-partial-prefills 1 "
                  "-sc '{\"model\": \"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B\", \"num_speculative_tokens\": 3}'",
                  "h100-sxm")
    assert t.raw["engine"] == {"enforce_eager": True, "kv_cache_memory_bytes": 20 * 2 ** 30,
                               "distributed_executor_backend": "ray", "long_prefill_token_threshold": 1000,
                               "max_num_partial_prefills": 1,
                               "speculative": {"method": "eagle3", "num_speculative_tokens": 3,
                                               "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}}
    assert not t.ignored and not t.unknown
    # (a method with no default acceptance keeps only its async effect: tests/whatif/test_speculative.py)
    for config, method in (('{"method": "deepseek_mtp"}', "mtp"), ('{"model": "ngram"}', "ngram"),
                           ("{method:ngram_gpu,num_speculative_tokens:3}", "ngram_gpu"),    # shell-unquoted
                           ('{"model": "some/draft-1b"}', "draft_model")):
        engine = translate(["vllm", "serve", "tiny", "--speculative-config", config], "cpu").raw["engine"]
        assert engine.get("speculative_method", engine.get("speculative", {}).get("method")) == method
    # vLLM's engine arguments refuse concurrent partial prefills (0.19 arg_utils.py _check_feature_supported)
    with pytest.raises(UserError, match="Concurrent Partial Prefill is not supported"):
        translate("vllm serve tiny --max-num-partial-prefills 2", "cpu")
    with pytest.raises(UserError, match="JSON object"):
        translate("vllm serve tiny --speculative-config eagle", "cpu")


def test_every_flag_issue_25_names_is_mapped():
    """vLLM 0.19 engine/arg_utils.py: --pipeline-parallel-size / -pp (0.14's auto async rule),
    --scheduler-reserve-full-isl (config/scheduler.py scheduler_reserve_full_isl, from 0.19),
    --performance-mode (from 0.17: throughput doubles the batch defaults); envs.py
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS set before the command. None is listed as ignored."""
    t = translate("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 CUDA_VISIBLE_DEVICES=0 vllm serve tiny -pp 2 "
                  "--no-scheduler-reserve-full-isl --performance-mode throughput", "h100-sxm")
    assert t.raw["engine"] == {"pipeline_parallel_size": 2, "reserve_full_prompt": False,
                               "performance_mode": "throughput", "estimate_cudagraph_memory": True}
    assert [flag for flag, _, _ in t.ignored] == ["CUDA_VISIBLE_DEVICES=0"] and not t.unknown
    assert any("pipeline parallel 2" in remark for remark in t.remarks)
    assert translate("env FOO=1 vllm serve tiny", "cpu").unknown == [("FOO=1 (environment)", None)]
    with pytest.raises(UserError, match="VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=maybe"):
        translate("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=maybe vllm serve tiny", "cpu")
    named = ("--pipeline-parallel-size", "-pp", "--scheduler-reserve-full-isl", "--performance-mode",
             "--enforce-eager", "--kv-cache-memory-bytes", "--distributed-executor-backend", "--speculative-config",
             "--long-prefill-token-threshold", "--max-num-partial-prefills", "--max-num-seqs",
             "--max-num-batched-tokens", "--gpu-memory-utilization", "--block-size", "--enable-prefix-caching",
             "--enable-chunked-prefill", "--async-scheduling")
    assert not [flag for flag in named if flag in IGNORED]
    assert all(flag in {n for m in MODELLED for n in (m.flag, *m.aliases)} for flag in named)


def test_cli_writes_the_vllm_version_and_what_async_scheduling_resolves_to(tmp_path):
    """`--vllm-version` lands in engine.vllm_version, which picks vLLM's defaults: 0.20 raises the
    utilization default to 0.92 (vllm 0.20.0 config/cache.py); the ray executor turns auto async
    scheduling off (0.19.0 config/vllm.py: executor_class.supports_async_scheduling() is False)."""
    out = tmp_path / "s.yaml"
    assert main(["from-vllm", "--device", "h100-sxm", "--vllm-version", "0.20.0", "--out", str(out), "--",
                 "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--distributed-executor-backend", "ray"]) == 0
    text = out.read_text()
    assert "async scheduling: off under auto (the ray executor does not support async scheduling)" in text
    scenario = load_scenario(out)
    assert scenario.engine.vllm_version == "0.20.0" and scenario.engine.gpu_memory_utilization == 0.92
    assert not scenario.async_scheduling
    assert main(["from-vllm", "--device", "h100-sxm", "--vllm-version", "latest", "vllm serve tiny"]) == 2


def test_public_vllm_commands_and_logged_args_translate_without_unknown_flags():
    """Real `vllm serve` lines and `non-default args:` dicts (tests/data/vllm_public, cited there)."""
    from pathlib import Path

    from sim.vllm.serve_flags import mapping_flags

    data = Path(__file__).resolve().parents[1] / "data" / "vllm_public"
    fast = getattr(yaml, "CSafeLoader", yaml.SafeLoader)        # the same safe loader, in C when built
    runs = yaml.load((data / "bench_runs.yaml").read_text(), Loader=fast)["runs"]
    commands = {r["server_command"] for r in runs if (r.get("server_command") or "").startswith("vllm serve")}
    assert len(commands) >= 10
    for command in commands:
        t = translate(command, "h100-sxm", model_name="tiny")
        assert not t.unknown, command
    logs = yaml.load((data / "startup_logs.yaml").read_text(), Loader=fast)["entries"]
    seen = 0
    for entry in logs:
        args = {k: v for k, v in (entry.get("non_default_args") or {}).items() if k != "model"}
        words = ["vllm", "serve", "tiny"]
        for flag, value in mapping_flags(args):
            words += [flag] if value is None else [flag, value]
        t = translate(words, "h100-sxm")
        assert not t.unknown, entry["id"]
        if args.get("max_model_len") is not None:
            assert t.raw["engine"]["max_model_len"] == args["max_model_len"]
            seen += 1
        if args.get("enable_prefix_caching") is not None:
            assert t.raw["engine"]["prefix_caching"] == args["enable_prefix_caching"], entry["id"]
    assert seen >= 60


def test_cli_out_file_follows_the_output_rules(tmp_path, capsys):
    command = ["--", "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "32"]
    out = tmp_path / "s.yaml"
    out.write_text("name: mine\n")                            # someone else's file
    assert main(["from-vllm", "--device", "h100-sxm", "--out", str(out), *command]) == 2
    assert "kvtwin did not write it" in capsys.readouterr().err and out.read_text() == "name: mine\n"
    assert main(["from-vllm", "--device", "h100-sxm", "--out", str(out), "--force", *command]) == 0
    assert main(["from-vllm", "--device", "h100-sxm", "--out", str(out), *command]) == 0   # its own: replaced
    assert out.read_text().startswith("# written by `simrun from-vllm` from: vllm serve")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]                       # no temp file left
    assert main(["from-vllm", "--device", "h100-sxm", "--out", str(tmp_path), *command]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["from-vllm", "--device", "h100-sxm", "--out", "", *command])
    assert exc.value.code == 2 and "empty path" in capsys.readouterr().err
