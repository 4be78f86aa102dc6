"""The trained step-time profile family (`step_times: trained`), its leave-one-deployment-out table
(docs/fidelity.md) and the error band every answer carries (sim/trained.py, `plan --pessimistic`).

The family and the table are written by `python -m validate.lodo`; these tests check that what is
committed is what that validation produces: the bands are recomputed from the table, the table's
errors are recomputed from each fold's stored coefficients (every figure within max(2 points,
10 %)), and two cheap folds are refitted from scratch."""
from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from sim.core.request import make_request
from sim.costmodel import CostCoefficients, CostModel, trained_coefficients, trained_profile
from sim.trained import band_words, error_band, family
from validate import lodo

TABLE = pd.read_csv(lodo.TABLE_FILE)
FAMILY = yaml.safe_load(lodo.FAMILY_FILE.read_text())
CHEAP = 200          # requests: the runs whose figures are recomputed here (the others in `validate.lodo`)


def band(recorded: float) -> float:
    return max(0.02, 0.1 * abs(recorded))


@pytest.fixture(scope="module")
def runs() -> dict[str, lodo.Run]:
    return {r.id: r for r in lodo.all_runs()[0]}


def test_the_validation_covers_gpus_parallelism_moe_and_rates():
    deployments = TABLE["deployment"].unique()
    assert len(deployments) >= 10 and FAMILY["validation"]["deployments"] == len(deployments)
    assert TABLE["gpu"].nunique() >= 4
    tps = {int(d.split(" / tp ")[1].split(" ")[0]) for d in deployments}
    assert tps >= {1, 2, 4, 8}
    assert any("Mixtral" in d or "gpt-oss" in d for d in deployments), "an MoE deployment"
    assert TABLE["run"].str.startswith("infsim-").sum() >= 10, "runs at several request rates"
    assert not TABLE["source"].str.contains("LLMServingSim").any()
    kept_back = (TABLE["gpu"].str.startswith(("rtx-4090", "rtx-pro-6000"))
                 & TABLE["deployment"].str.contains(r"vLLM 0\.19"))
    assert not kept_back.any(), "the vLLM 0.19 RTX 4090 / RTX PRO 6000 runs are the independent check"
    if FAMILY.get("data_pass", 1) >= 2:      # the second data pass (validate/lodo.py LATEST_DATA_PASS)
        assert len(deployments) >= 40 and TABLE["gpu"].nunique() >= 8
        assert {"rtx-4090", "rtx-6000-ada", "rtx-a6000", "l4"} <= set(TABLE["gpu"]), "consumer and workstation cards"
        moe = ("Mixtral", "gpt-oss", "A22B", "A3B")
        assert sum(any(m in d for m in moe) for d in deployments) >= 5, "MoE deployments"
        rates = TABLE.loc[TABLE["run"].str.startswith("accelmark-"), "run"].str.extract(r"-qps([\d_.]+)$")[0]
        assert rates.nunique() >= 6, "Poisson runs at several rates"


def test_the_loader_follows_the_committed_data_pass(runs):
    """The table pins the runs of the pass the family was fitted on: the loader gives exactly those."""
    assert lodo.committed_data_pass() == FAMILY.get("data_pass", 1) <= lodo.LATEST_DATA_PASS
    assert set(runs) == set(TABLE["run"])


def test_replayed_runs_start_with_the_prefix_cache_their_server_held(runs):
    """vLLM's benchmarks/benchmark_serving.py (0.10.1.1, 0.8.3) sends its first prompt once, the
    "initial single prompt test run", before the benchmark; at the default seed a run of the same
    dataset sends the prompts an earlier run on that server sent (validate/lodo.py
    _bench_requests, _after_earlier_runs). Every replayed run starts after its warm-up requests."""
    def split(run):
        return ([q.segments[0][0] for q in run.requests if q.is_warmup],
                [q.segments[0][0] for q in run.requests if not q.is_warmup])

    warm, measured = split(runs["dennislee-test2-19"])      # 10 prompts after runs 17, 18 of 10
    assert set(measured) <= set(warm)
    warm, measured = split(runs["dennislee-test2-17"])      # 10 prompts after 1, 20, 30, 75
    assert measured[0] in warm and not set(measured[1:]) & set(warm)
    surajssd = "surajssd-llama-3.3-70b-a100-40g-tp8-"
    assert len(split(runs[surajssd + "qps01"])[0]) == 1 and len(split(runs[surajssd + "qps04"])[0]) == 200
    # the earlier runs as they ran (validate/lodo.py _bench_requests): all at once, with their
    # outputs, one run after the other's measured duration, so run 24's 100 x (4096 + 3977) tokens
    # pass through the 450k-token pool and evict what the runs before it cached
    warm = [q for q in runs["dennislee-test2-25"].requests if q.is_warmup]
    sent = {q.output_len: q.arrival for q in warm}
    assert {1017, 3977} <= set(sent) and sent[3977] >= sent[1017] + 35.12, "run 24 after run 23's 35.12 s"
    for run_id in ("dennislee-test2-19", surajssd + "qps04", "infsim-llama-2-70b-hf-tp4-codegen-rate10"):
        run = runs[run_id]
        last_warmup = max(q.arrival for q in run.requests if q.is_warmup)
        assert min(q.arrival for q in run.requests if not q.is_warmup) >= last_warmup + 1.0


def test_the_l4_sweep_replays_its_job(runs):
    """The L4 page's six levels ran one after another in one Job against one server
    (k8s-llm-inference-platform benchmarks/job.yaml at 221552cc): `vllm bench serve --backend
    openai-chat --seed 42`, 20 prompts per client slot and at most 320, so the server wraps each
    prompt in Qwen2.5's chat template (29 tokens) and, vLLM 0.23.0's random dataset drawing prompt
    i's offset as the i-th of default_rng(seed).integers(0, vocab, size=num_prompts) after length
    draws over a single value that consume nothing (vllm/benchmarks/datasets/utils.py
    get_sampling_params), every level sends the prompts of the levels before it again: the 320 of
    the concurrency-32 level are all cached. The page gives medians: kvtwin's medians are compared."""
    def offsets(count):
        rng = np.random.default_rng(42)
        rng.integers(256, 257, size=count), rng.integers(128, 129, size=count)
        return rng.integers(0, 151643, size=count)
    assert (offsets(20) == offsets(320)[:20]).all(), "prompt i is the same at any prompt count"

    def split(run):
        return ({q.segments[0][0] for q in run.requests if q.is_warmup},
                [q for q in run.requests if not q.is_warmup])

    level = {c: runs[f"wmx-l4-qwen2.5-0.5b-c{c}"] for c in (1, 2, 16, 32)}
    assert [len(split(r)[1]) for r in level.values()] == [20, 40, 320, 320]
    warm, measured = split(level[1])
    assert {q.prompt_len for q in measured} == {256 + 29} and len(warm) == 1 and measured[0].segments[0][0] in warm
    warm, measured = split(level[2])
    assert sum(q.segments[0][0] in warm for q in measured) == 20, "the 20 prompts of the first level"
    warm, measured = split(level[32])
    assert all(q.segments[0][0] in warm for q in measured)
    assert all(r.centre == "median" for r in level.values())


def test_inference_perf_stages_replay_the_tokens_vllm_generated(runs):
    """inference-perf sends max_tokens = the shared_prefix output_len with ignore_eos
    (inference_perf/datagen/shared_prefix_datagen.py: CompletionAPIData(max_tokens=self.output_len))
    and counts a response's output by re-tokenizing its streamed text (inference_perf/apis/
    completion.py process_response: tokenizer.count_tokens(output_text)). vLLM with ignore_eos
    stops only at max_tokens and leaves special tokens out of the text (vllm/sampling_params.py,
    release 0.19.1 from the package registry, and commit 00388f65: SamplingParams ignore_eos
    "continue generating tokens after the EOS token", skip_special_tokens: bool = True): Llama-2-7b's stages count 78-85 % of their tokens. The replay
    generates max_tokens, and vLLM's TPOT is (E2E - TTFT) / (max_tokens - 1)."""
    entries = {e["id"]: e for e in yaml.safe_load(lodo.RATE_FILE.read_text())["runs"]}
    for run_id in ("infsim-llama-2-7b-tp1-general-rate8", "infsim-mixtral-8x7b-v0-1-tp2-codegen-rate5"):
        w, m = entries[run_id]["workload"], entries[run_id]["metrics"]
        assert w["ignore_eos"] and w["client"] == "inference-perf"
        measured = [r for r in runs[run_id].requests if not r.is_warmup]
        assert {r.output_len for r in measured} == {w["shared_prefix"]["output_len"]}
        assert runs[run_id].measured["tpot_mean"] == pytest.approx(
            (m["e2e_s"]["mean"] - m["ttft_s"]["mean"]) / (w["shared_prefix"]["output_len"] - 1))
    counted = entries["infsim-llama-2-7b-tp1-general-rate8"]["workload"]
    assert counted["output_len_mean"] < 0.9 * counted["shared_prefix"]["output_len"]
    assert lodo.stage_output_len({**counted, "ignore_eos": False}) == counted["output_len_mean"]


def test_accelmark_outputs_stop_at_eos_or_max_tokens_around_the_published_mean(runs):
    """AccelMark's runner decodes greedily to max_tokens without ignore_eos
    (https://github.com/FreedomIntelligence/AccelMark/blob/5797fc42745be2494e6213938d9e5afa0c6c5bef/runners/nvidia_vllm_47f5d58e/runner.py
    `load_model`: SamplingParams(max_tokens=max_tokens, temperature=0.0)), so vLLM 0.7.3 ends each
    request at the model's EOS or the cap; the results publish only the mean. Its TPOT is per
    request, (total - TTFT) / max(output - 1, 1), pooled into percentiles
    (https://github.com/FreedomIntelligence/AccelMark/blob/5797fc42745be2494e6213938d9e5afa0c6c5bef/loadgen/loadgen.py
    `_run_online_async`): a request of a few tokens that waits out a V0 prefill step is its p99.
    The replay keeps the mean with early stops below the cap
    (`eos_stopped_lengths`), the same lengths on every GPU for one model's prompts (greedy), and
    the few-token requests lift the replayed TPOT p99 the way they lift the measured one."""
    entries = {e["id"]: e for e in yaml.safe_load(lodo.RATE_FILE.read_text())["runs"]
               if e["workload"]["client"] == "accelmark"}
    assert lodo.REPLAY_REVISION["v0"] == 8    # with the asyncio loop and the eager prefill steps
    for run_id in ("accelmark-llama-3-8b-h100-tp1-qps5", "accelmark-qwen2.5-0.5b-t4-tp1-qps10"):
        w, run = entries[run_id]["workload"], runs[run_id]
        lengths = [q.output_len for q in run.requests]
        assert max(lengths) == w["max_tokens"] and min(lengths) == 1
        assert abs(np.mean(lengths) - w["output_len_mean"]) < 1
        assert lengths.count(w["max_tokens"]) == len(lengths) - round(len(lengths) * 2 * (
            w["max_tokens"] - round(w["output_len_mean"])) / w["max_tokens"])
    same_model = [runs[i] for i in ("accelmark-llama-3-8b-h100-tp1-qps5", "accelmark-llama-3-8b-l4-tp1-qps5")]
    assert [q.output_len for q in same_model[0].requests] == [q.output_len for q in same_model[1].requests]

    run = runs["accelmark-llama-3-8b-a100-40g-tp1-qps25"]      # measured TPOT p99 / p50: 2.0
    mean = round(entries[run.id]["workload"]["output_len_mean"])
    uniform = copy.copy(run)
    uniform.requests = [make_request(q.id, q.arrival, q.segments[:-1], mean) for q in run.requests]
    a100 = trained_coefficients(FAMILY["engines"]["v0"]["classes"]["a100-40g"]["parameters"])
    spread, one = (lodo.predict(r, a100) for r in (run, uniform))
    assert spread["tpot_p99"] > 1.3 * one["tpot_p99"], "the short requests' stalls make the tail"


def test_an_overloaded_stage_is_left_out():
    """inference-sim's CodeLlama-34b reasoning stage served 3.2 of the 4 req/s it was sent (mean TTFT
    120 s: its queue grew for 1200 s), which no WINDOW_S replay reproduces; it is left out, as the
    source leaves out its other overloaded reasoning experiments."""
    runs, skipped = lodo.all_runs()
    assert "infsim-codellama-34b-tp2-reasoning-rate4" not in {r.id for r in runs}
    assert sum(n for reason, n in skipped.items() if reason.startswith("overloaded stage")) == 1
    assert "infsim-codellama-34b-tp2-general-rate20" in {r.id for r in runs}


def test_gpustack_chat_runs_replay_the_chat_template(runs):
    """GPUStack's performance lab (gpustack/gpustack at 47277d79, docs/performance-lab/*) benchmarks
    with `vllm bench serve --backend openai-chat`: each random prompt goes out as a user message and
    the server prefills it inside the model's chat template. vLLM 0.10.2/0.11.0 render gpt-oss
    requests with openai_harmony (vllm/entrypoints/openai/serving_chat.py
    `_make_request_with_harmony`): the default system message (vllm/entrypoints/harmony_utils.py
    `get_system_message`), an empty developer message, the user message and the assistant header,
    67 tokens around the prompt; Qwen3's template wraps it in 8. The client counts the bare prompt
    (127.755 tokens per 128-token request), so the replay adds the template: for 1000 x 128/4 it is
    a third of what gpt-oss prefills."""
    oss, qwen = runs["gpustack-gpt-oss-20b-h100-07"], runs["gpustack-qwen3-32b-h100-05"]
    assert {q.prompt_len for q in oss.requests if not q.is_warmup} == {128 + 67}
    assert {q.prompt_len for q in qwen.requests if not q.is_warmup} == {128 + 8}


def test_gpt_oss_requests_share_the_harmony_head_that_vllms_prefix_cache_serves(runs):
    """vLLM renders every gpt-oss chat request as harmony's system message, an empty developer
    message, then the user's (vllm/entrypoints/openai/serving_chat.py 0.11.0
    `_make_request_with_harmony`); the system message is the same for every request of a day
    (vllm/entrypoints/harmony_utils.py `get_system_message`: the current date), and V1 turns the
    prefix cache on by default (vllm/engine/arg_utils.py `_set_default_args`). So 61 of the 67
    template tokens (all but `<|start|>user<|message|>` and `<|end|><|start|>assistant` around the
    prompt) are one shared segment, whose three full 16-token blocks the cache serves: GPUStack's
    gpt-oss-20b A100 128/4 run prefills 147 of its 195 tokens per request, not 195. Qwen3's head
    (`<|im_start|>user\n`, 3 tokens) fills no block and is not replayed as shared."""
    oss = [q for q in runs["gpustack-gpt-oss-20b-a100-08"].requests if not q.is_warmup]
    heads = {q.segments[0] for q in oss}
    assert len(heads) == 1 and next(iter(heads))[1] == 61
    assert {q.prompt_len for q in oss} == {128 + 67}
    assert len({q.segments[1][0] for q in oss}) == len(oss)          # the rest stays each request's own
    qwen = [q for q in runs["gpustack-qwen3-32b-h100-05"].requests if not q.is_warmup]
    assert len({q.segments[0] for q in qwen}) == len(qwen)


def test_mxfp4_experts_take_marlins_padded_shapes_on_gpus_below_hopper(runs):
    """vLLM 0.11.0 runs mxfp4 MoE experts with the Marlin kernel wherever the GPU's compute
    capability is below 9 (vllm/model_executor/layers/quantization/mxfp4.py `get_mxfp4_backend`),
    and Marlin allocates the expert tensors padded: hidden size to a multiple of 256, intermediate
    size per partition to a multiple of 128 (`Mxfp4MoEMethod.create_weights`). gpt-oss-120b's
    2880 x 2880 experts become 3072 x 2944: 65.9 GiB of weights on one GPU where the checkpoint holds
    60.8, as vLLM logged a Marlin load ("Model loading took 65.9651 GiB", vllm-project/vllm#23278).
    GPUStack's A100 runs of it lose more than half their KV pool to that (17178 -> 7845 blocks)."""
    from sim.core.catalog import get_device
    from sim.core.memory import marlin_mxfp4_padding_bytes, vllm_memory_plan, weight_bytes_per_gpu

    oss = lodo.model_spec("openai/gpt-oss-120b")
    a100, h100 = get_device("a100-80g"), get_device("h100-sxm")
    plan = vllm_memory_plan(oss, a100, 1, 0.9, 2048, 256, vllm_version="0.11.0")
    assert plan.weight_bytes / 2**30 == pytest.approx(65.9, abs=0.1)
    assert weight_bytes_per_gpu(oss) / 2**30 == pytest.approx(60.8, abs=0.1)
    assert marlin_mxfp4_padding_bytes(oss, h100) == 0          # fp8 tensor cores: not Marlin's padding
    assert marlin_mxfp4_padding_bytes(lodo.model_spec("Qwen/Qwen3-32B"), a100) == 0
    assert runs["gpustack-gpt-oss-120b-a100-07"].scenario.engine.num_blocks == 7845
    # dennislee22's four A100s (tests/data/vllm_public/startup_logs.yaml, vLLM 0.10.1.1, tp 4) logged
    # "Model loading took 17.2217 GiB" per GPU: 15.2 GiB unpadded, 17.1 with the 3072 x 768 slices
    padded = weight_bytes_per_gpu(oss, 4) + marlin_mxfp4_padding_bytes(oss, a100, 4)
    assert padded / 2**30 == pytest.approx(17.22, abs=0.1)


def test_bands_are_computed_from_the_table_not_typed_in():
    assert FAMILY["validation"]["bands"] == lodo.bands(TABLE)
    assert FAMILY["validation"]["bands_by_engine"] == lodo.bands_by_engine(TABLE)
    for source in ("datasheet", "trained"):
        assert set(FAMILY["validation"]["bands"][source]) >= {"ttft_mean", "tpot_mean", "e2e_mean", "throughput"}


def test_every_class_parameter_is_physical():
    for engine, fitted in FAMILY["engines"].items():
        for gpu, entry in fitted["classes"].items():
            p = entry["parameters"]
            assert set(p) <= set(lodo.FIT_NAMES[engine]), (engine, gpu)
            c = trained_coefficients(p)
            for eff in ("flops_eff", "attn_flops_eff", "attn_bw_eff", "bw_eff"):
                assert 0.05 < getattr(c, eff) <= 1.0 + 1e-9, (engine, gpu, eff)
            assert 0 < p.get("link_eff", 1.0) <= 1.0 and 0 < p.get("host_staging_eff", 0.5) <= 1.0, (engine, gpu)
            for term in ("step_host_s", "seq_host_s", "prefill_seq_host_s", "expert_n_half"):
                low, high = lodo.BOUNDS[term]
                assert low * 0.999 <= p.get(term, low) <= high * 1.001, (engine, gpu, term)
        counts = {g: len(e["deployments"]) for g, e in fitted["classes"].items()}
        assert fitted["generic"] == {k: pytest.approx(v, rel=1e-4) for k, v in lodo.generic(
            {g: e["parameters"] for g, e in fitted["classes"].items()}, counts).items()}


def test_the_expert_kernel_term_is_fitted_only_where_a_moe_model_ran(runs):
    """expert_n_half (the fused-MoE kernel's efficiency on the expert slices) acts on MoE models only,
    so a V1 class with a MoE deployment fits it and one without does not; its link efficiency is left
    to the tp all-reduces (V0 keeps the datasheet's efficiencies)."""
    moe = [r for r in runs.values() if r.scenario.model.is_moe]
    dense = [r for r in runs.values() if not r.scenario.model.is_moe]
    assert lodo.parameter_acts("expert_n_half", moe[:1]) and not lodo.parameter_acts("expert_n_half", dense)
    by_deployment = lodo.deployments(list(runs.values()))
    for engine, fitted in FAMILY["engines"].items():
        for gpu, entry in fitted["classes"].items():
            has_moe = any(by_deployment[d][0].scenario.model.is_moe for d in entry["deployments"])
            expected = has_moe and engine == "v1"
            assert ("expert_n_half" in entry["parameters"]) == expected, (engine, gpu)


def test_each_engine_generation_is_fitted_on_its_own_runs(runs):
    """A V1 scenario never uses coefficients fitted on V0 runs, nor V0 on V1 (V1 became vLLM's
    default engine in 0.8.0: vllm/envs.py VLLM_USE_V1, 0.8.0)."""
    for engine, fitted in FAMILY["engines"].items():
        for gpu, entry in fitted["classes"].items():
            assert entry["deployments"] and all(lodo.deployment_engine(d) == engine for d in entry["deployments"])
            assert all(lodo.GPUS[d.split(" / ")[1]] == gpu for d in entry["deployments"]), (engine, gpu)
    assert set(FAMILY["engines"]) == {"v0", "v1"}
    mixed = [next(r for r in runs.values() if r.engine == gen) for gen in ("v0", "v1")]
    with pytest.raises(ValueError, match="one engine generation"):
        lodo.fit_class(mixed)


def test_v0_classes_share_one_host_profile():
    """V0's host cost is the machine's CPU running vLLM 0.7.3's Python loop (and AccelMark's load
    generator) between GPU steps (vllm/engine/llm_engine.py step(), 0.7.3), not the GPU's: every V0
    class prices the pooled host profile times its machine's speed, so the per-step, per-sequence
    and per-admitted-prompt terms keep one ratio across classes; the efficiencies stay the datasheet's."""
    classes = FAMILY["engines"]["v0"]["classes"]
    ratios = [(p["seq_host_s"] / p["step_host_s"], p["prefill_seq_host_s"] / p["step_host_s"])
              for p in (c["parameters"] for c in classes.values())]
    for seq, prefill in ratios[1:]:
        assert seq == pytest.approx(ratios[0][0], rel=1e-3) and prefill == pytest.approx(ratios[0][1], rel=1e-3)
    assert not any({"compute_scale", "memory_scale"} & set(c["parameters"]) for c in classes.values())


def test_a_v0_class_fits_its_machine_speed_over_the_pooled_host_profile(runs, monkeypatch):
    """A V0 class fits host_scale, one factor on every term of the pooled V0 host profile (its
    machine's CPU running the same Python loop). Replays stubbed so that the two runs of a
    deployment want 2x the pooled host time, their metrics moving as host_time ** 0.1 (a
    device-bound model's ~50 ms steps hide a host's ~3 ms): the fit reaches 2x on every term."""
    group = [r for r in runs.values() if r.deployment == "meta-llama/Meta-Llama-3-8B-Instruct / L4 / tp 1 / vLLM 0.7.3"]
    pooled = {"step_host_s": 2e-3, "seq_host_s": 50e-6, "prefill_seq_host_s": 0.3e-3, "eager_layer_host_s": 0.5e-3}

    def stub(run, coefficients=None, step_times="datasheet", profile=None, front_end_s=0.0):
        factor = (coefficients.step_host_s / (2 * pooled["step_host_s"])) ** 0.1
        return {m: v * factor for m, v in run.measured.items()}

    monkeypatch.setattr(lodo, "predict", stub)
    fitted = lodo.fit_class(group, fixed=pooled, names=lodo.V0_CLASS_FIT)
    assert 1.9 <= fitted["step_host_s"] / pooled["step_host_s"] <= 2.1
    for term in lodo.V0_HOST:
        assert fitted[term] / pooled[term] == pytest.approx(fitted["step_host_s"] / pooled["step_host_s"]), term
    assert "host_scale" not in fitted


@pytest.mark.parametrize("run_id", TABLE.loc[TABLE["requests"] <= CHEAP, "run"].tolist())
def test_recorded_lodo_errors_still_hold(run_id, runs):
    """Each run's datasheet and trained errors, recomputed with its fold's stored coefficients."""
    row = TABLE.set_index("run").loc[run_id]
    run = runs[run_id]
    params = {n: float(row[f"fold {n}"]) for n in lodo.NAMES if pd.notna(row.get(f"fold {n}"))}
    # the fold's API-server time per request (every source's replay)
    front = {"front_end_s": float(row["fold front_end_s"]) if pd.notna(row.get("fold front_end_s")) else 0.0}
    now = {f"datasheet {k}": v for k, v in lodo.errors(run, lodo.predict(run, CostCoefficients(), **front)).items()}
    trained = trained_coefficients(params)
    now.update({f"trained {k}": v for k, v in lodo.errors(run, lodo.predict(run, trained, **front)).items()})
    off = {k: (round(v, 4), round(row[k], 4)) for k, v in now.items() if abs(v - row[k]) > band(row[k])}
    assert not off, f"{run_id}: errors moved beyond their bands (now, recorded): {off}"


@pytest.mark.parametrize("deployment", [
    "Qwen/Qwen2.5-0.5B-Instruct / L4 / tp 1 / vLLM 0.23.0",   # no other V1 L4: the V1 generic profile
    "Qwen/Qwen2.5-0.5B-Instruct / L4 / tp 1 / vLLM 0.7.3",    # refitted on the other V0 L4 deployment
])
def test_a_fold_is_reproducible_and_never_sees_its_deployment(deployment, runs, monkeypatch):
    seen = []
    fit = lodo.fit_class
    monkeypatch.setattr(lodo, "fit_class", lambda rs, **kw: seen.extend(r.deployment for r in rs) or fit(rs, **kw))
    all_runs = list(runs.values())
    full = lodo.committed_params(FAMILY)
    now = lodo.lodo_table(all_runs, full, only=[deployment], progress=lambda *_: None).set_index("run")
    assert deployment not in seen
    assert {lodo.deployment_engine(d) for d in seen} <= {lodo.deployment_engine(deployment)}
    if lodo.deployment_engine(deployment) == "v0":   # host: pooled over the other models
        assert lodo.deployment_model(deployment) not in {lodo.deployment_model(d) for d in seen}
    recorded = TABLE.set_index("run").loc[now.index]
    for col in [c for c in now.columns if c.startswith(("trained ", "fold "))]:
        for run_id in now.index:
            a, b = now.loc[run_id, col], recorded.loc[run_id, col]
            assert abs(a - b) <= max(0.02, 0.1 * abs(b)), f"{run_id} {col}: now {a:.4g}, recorded {b:.4g}"


def test_a_resumed_refit_reuses_the_folds_it_kept(runs, tmp_path, monkeypatch):
    """`--resume DIR`: a fold finished once is read back, not refitted (a refit killed half way resumes)."""
    deployment = "Qwen/Qwen2.5-0.5B-Instruct / L4 / tp 1 / vLLM 0.23.0"
    full = lodo.committed_params(FAMILY)
    monkeypatch.setitem(lodo._FOLD_STATE, "resume", tmp_path)
    first = lodo.lodo_table(list(runs.values()), full, only=[deployment], progress=lambda *_: None)
    assert len(list(tmp_path.glob("fold-*.json"))) == 1

    def refit(*args, **kwargs):
        raise AssertionError("a kept fold was refitted")

    monkeypatch.setattr(lodo, "fold_params", refit)
    again = lodo.lodo_table(list(runs.values()), full, only=[deployment], progress=lambda *_: None)
    pd.testing.assert_frame_equal(first, again)
    # a change to how V1 runs are replayed (its REPLAY_REVISION) leaves the kept fold unused
    monkeypatch.setitem(lodo.REPLAY_REVISION, "v1", lodo.REPLAY_REVISION["v1"] + 1)
    with pytest.raises(AssertionError, match="a kept fold was refitted"):
        lodo.lodo_table(list(runs.values()), full, only=[deployment], progress=lambda *_: None)


def test_trained_step_times_load_the_class_profile_of_the_engine_generation_and_fall_back_to_generic():
    from sim.scenario import validate_scenario

    v1, v0 = FAMILY["engines"]["v1"], FAMILY["engines"]["v0"]
    for version, fitted in ((None, v1), ("0.19.1", v1), ("0.7.3", v0)):
        engine = {"vllm_version": version} if version else {}          # None: the default release (V1)
        scenario = validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "step_times": "trained",
                                      "engine": engine})
        cost = CostModel.for_scenario(scenario)
        expected = trained_coefficients(fitted["classes"]["h100-sxm"]["parameters"])
        assert cost.step_time_source == "trained" and cost.coefficients == expected, version
        assert not cost.calibrated
    assert trained_profile("h100-sxm", "v0").coefficients != trained_profile("h100-sxm", "v1").coefficients
    for engine, fitted in (("v1", v1), ("v0", v0)):
        other = trained_profile("b200", engine)           # no public run measured one
        assert other.fit["class"] == "generic" and other.fit["engine"] == engine
        assert other.coefficients == trained_coefficients(fitted["generic"])
    t4 = trained_profile("t4", "v1")                      # measured under V0 only: V1's generic, not V0's T4
    assert t4.fit["class"] == "generic" and t4.coefficients == trained_coefficients(v1["generic"])


def test_a_class_of_one_deployment_is_priced_by_the_generic_entry():
    """Leave-one-deployment-out predicts a class's only deployment with the generic entry, so no held-out
    run ever tested a fit made on one deployment (the V1 ones sit on their search bounds): the generic
    entry prices such a GPU, and the profile says why."""
    from sim.costmodel import trained_coefficients, trained_profile
    from sim.trained import MIN_CLASS_DEPLOYMENTS, class_entry

    engines = family()["engines"]
    for engine, entry in engines.items():
        for device, fitted in entry["classes"].items():
            profile = trained_profile(device, engine)
            alone = len(fitted["deployments"]) < MIN_CLASS_DEPLOYMENTS
            assert profile.fit["class"] == ("generic" if alone else device), (engine, device)
            expected = entry["generic"] if alone else fitted["parameters"]
            assert profile.coefficients == trained_coefficients(expected)
    assert len(class_entry("l4", "v1")["deployments"]) == 1           # Qwen2.5-0.5B on one L4
    assert "one public vLLM V1 deployment on l4" in trained_profile("l4", "v1").source
    assert trained_profile("a100-80g", "v1").fit["class"] == "a100-80g"


def test_every_answer_states_its_band_from_the_validation(capsys):
    from sim.output.run_table import answer_line
    from sim.predict import predict
    from sim.scenario import validate_scenario

    scenario = validate_scenario({"model": "llama-3.1-8b", "device": "l4", "step_times": "trained",
                                  "engine": {"max_model_len": 2048},
                                  "workload": {"num_requests": 30, "arrival": {"process": "poisson", "rate": 2}}})
    summary = predict(scenario, manifest=False).summary
    validated = family()["validation"]["bands_by_engine"]["v1"]["trained"]   # the default release is V1
    assert summary["error_band"]["source"] == "trained"
    assert summary["error_band"]["tpot_p99"]["typical"] == validated["tpot_p99"]["typical"]
    line = answer_line("x", summary)
    typical = validated["tpot_p99"]["typical"] * 100
    assert f"(typical error +-{typical:.0f} %, from {validated['tpot_p99']['deployments']} held-out deployments)" in line


def test_a_band_comes_from_the_deployments_of_the_scenarios_engine_generation():
    """V1 became vLLM's default engine in 0.8.0 (vllm/envs.py VLLM_USE_V1 default, 0.8.0): a 0.7.3
    scenario's band is the V0 deployments', a 0.19 one's the V1 deployments' (the two differ: V0's
    runs carry a host cost kvtwin does not price)."""
    from sim.core.vllm_versions import engine_generation
    from sim.trained import error_band

    assert [engine_generation(v) for v in ("0.7.3", "0.8.0", "0.19.1", None)] == ["v0", "v1", "v1", "v1"]
    assert lodo.deployment_engine("m / H100 / tp 1 / vLLM 0.7.3") == "v0"
    assert lodo.deployment_engine("m / H100 / tp 1 / vLLM not stated") == "v1"
    per_engine = FAMILY["validation"]["bands_by_engine"]
    for gen in ("v0", "v1"):
        band = error_band("datasheet", engine=gen)
        assert band["tpot_mean"]["typical"] == per_engine[gen]["datasheet"]["tpot_mean"]["typical"]
        assert gen.upper() in band["basis"]
    assert error_band("datasheet", engine="v1")["tpot_mean"] != error_band("datasheet", engine="v0")["tpot_mean"]
    deps = TABLE["deployment"].drop_duplicates()
    assert per_engine["v1"]["datasheet"]["ttft_mean"]["deployments"] + \
        per_engine["v0"]["datasheet"]["ttft_mean"]["deployments"] == len(deps)


def test_a_calibrated_profile_carries_the_band_of_its_held_out_run():
    from sim.costmodel import DeviceProfile

    profile = DeviceProfile(calibrated=True, fit={"errors": [
        {"run": "b.json", "role": "held out", "metric": "tpot", "error": -0.031},
        {"run": "a.json", "role": "fitted", "metric": "tpot", "error": 0.5}]})
    b = error_band("calibrated", profile)
    assert b["tpot_p99"]["typical"] == 0.031 and "b.json" in b["basis"]
    assert band_words(b, "tpot_p99") == " (typical error +-3 %, from its held-out run)"
    assert error_band("calibrated", DeviceProfile(calibrated=True)) is None


def test_pessimistic_plan_tightens_each_slo_by_its_band():
    from sim.whatif.plan import PlanError, parse_slo, pessimistic_slos

    b = error_band("trained")
    tight = pessimistic_slos([parse_slo("tpot_p99=0.1"), parse_slo("ttft_mean=1"), parse_slo("itl_p90=0.2")], b)
    assert math.isclose(tight[0].limit_s, 0.1 / (1 + b["tpot_p99"]["typical"]))
    assert math.isclose(tight[1].limit_s, 1 / (1 + b["ttft_mean"]["typical"]))
    assert math.isclose(tight[2].limit_s, 0.2 / (1 + b["tpot_p99"]["typical"]))
    with pytest.raises(PlanError, match="--pessimistic: no validated error band"):
        pessimistic_slos([parse_slo("tpot_p99=0.1")], None)


def test_plan_pessimistic_answers_as_if_each_slo_were_tightened_by_its_band(tmp_path, capsys):
    """`--pessimistic` at limit L gives the plain plan's answer at L / (1 + typical error)."""
    from sim.cli import main

    small = {"name": "small", "seed": 0, "model": "llama-3.1-8b", "device": "l4", "step_times": "trained",
             "engine": {"max_model_len": 1024, "prefix_caching": False, "max_num_seqs": 16},
             "workload": {"num_requests": 120, "warmup_requests": 10, "arrival": {"process": "poisson", "rate": 2},
                          "prompt_len": {"dist": "uniform", "min": 64, "max": 256},
                          "output_len": {"dist": "uniform", "min": 16, "max": 64}}}
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small))
    # the L4's V1 profile (the generic entry: one public V1 deployment on an L4) gives a TPOT p99 of
    # ~67-75 ms here at every rate (16 sequences at most): a limit whose tightened edge (72 ms) falls
    # inside that range makes the band bind before the queue does
    limit = round(0.072 * (1 + error_band("trained")["tpot_p99"]["typical"]), 4)
    tight = limit / (1 + error_band("trained")["tpot_p99"]["typical"])

    def plan(limit: float, *flags: str) -> tuple[pd.DataFrame, str]:
        out = tmp_path / f"plan{limit}{''.join(flags)}"
        assert main(["plan", str(path), "--slo", f"tpot_p99={limit}", "--out", str(out), "--jobs", "1",
                     "--tolerance", "0.05", *flags]) == 0
        return pd.read_csv(out / "plan.csv"), capsys.readouterr().out

    pessimistic, printed = plan(limit, "--pessimistic")
    assert f"pessimistic: SLO limits tightened to tpot_p99 <= {tight * 1e3:.3g} ms" in printed
    assert "typical error +-" in printed
    assert (pessimistic.loc[pessimistic["ok"], "tpot_s.p99"] <= tight).all()
    plain_tight, _ = plan(tight)
    plain, _ = plan(limit)
    best = {name: c.loc[c["ok"], "rate"].max() for name, c in
            (("pessimistic", pessimistic), ("tight", plain_tight), ("plain", plain))}
    assert best["pessimistic"] == best["tight"] <= best["plain"]
    assert pessimistic.loc[~pessimistic["ok"], "failed"].str.contains("tpot_p99").any(), "the band must bind"

def test_the_html_report_states_the_band():
    from sim.output.pages import band_line

    b = error_band("trained")
    line = band_line("run", b)
    assert line.startswith("Error band (run, step times trained): TTFT p99 (typical error +-")
    assert f"from {b['throughput']['deployments']} held-out deployments" in line
    assert band_line("run", None) == ""


def test_the_default_step_times_follow_the_validation():
    """`trained` is the default only where its held-out error beats datasheet and tables on every
    metric (issue 25); the decision is read from the committed validation, not typed in."""
    from sim.scenario import Scenario

    wins = lodo.trained_wins(TABLE)
    assert FAMILY["validation"]["trained_beats_datasheet_and_tables"] == wins
    expected = "trained" if wins and all(wins.values()) else "datasheet"
    assert Scenario.model_fields["step_times"].default == expected


def test_the_generic_entry_averages_the_classes_of_two_deployments_or_more():
    """validate.lodo.generic: the generic entry (and a one-deployment class's fold) leaves out the
    fits sim.trained.tested_class does not price with, which no held-out run tested; where no class
    is tested, every class counts."""
    from sim.trained import tested_class

    params = {"a": {"compute_scale": 1.0}, "b": {"compute_scale": 4.0}, "lone": {"compute_scale": 0.125}}
    counts = {"a": 3, "b": 2, "lone": 1}
    assert [tested_class(n) for n in (1, 2, 3)] == [False, True, True]
    assert lodo.generic(params, counts)["compute_scale"] == pytest.approx(2.0)
    assert lodo.generic({"lone": params["lone"]}, counts)["compute_scale"] == pytest.approx(0.125)


def test_a_generic_fold_names_its_profile(runs):
    """A fold priced by the generic profile is kept under a --resume name carrying that profile (a
    change of the other classes' fits or of the generic rule refits it); a refitted fold is not."""
    all_runs = list(runs.values())
    full = lodo.committed_params(FAMILY)
    lone = lodo.fold_generic(all_runs, "Qwen/Qwen2.5-0.5B-Instruct / L4 / tp 1 / vLLM 0.23.0", full)
    counts = lodo.class_deployments(all_runs, "v1")
    assert lone == lodo.generic({g: p for g, p in full["v1"].items() if g != "l4"}, counts)
    assert lodo.fold_generic(all_runs, "Qwen/Qwen2.5-0.5B-Instruct / L4 / tp 1 / vLLM 0.7.3", full) is None
