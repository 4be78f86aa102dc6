"""Records spilled to disk (sim/output/streamed.py): the same summary.json, requests.csv and steps.csv,
byte for byte, as the run kept in memory; chunk and block sizes made small so a few thousand
requests span many chunks and blocks."""
import json
from pathlib import Path

import pytest

import sim.exact_disk as exact_disk
import sim.output.streamed as streamed
from sim.errors import UserError
from sim.output.run_files import write_data_files
from sim.predict import predict
from sim.records import RequestTable, StepRecorder
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def fleet(*extra):
    return load_scenario(ROOT / "scenarios" / "fleet_64.yaml",
                         ["cluster.replicas=4", "workload.num_requests=3000", "workload.arrival.rate=400",
                          "workload.warmup_requests=50", *extra])


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(RequestTable, "CHUNK", 256)
    monkeypatch.setattr(StepRecorder, "CHUNK", 100)
    monkeypatch.setattr(streamed.SpilledStepRecorder, "CHUNK", 100)
    monkeypatch.setattr(streamed, "BLOCK", 500)
    # the summary's sums split into numpy calls, its percentiles' buckets counted before they load
    monkeypatch.setattr(exact_disk, "LEAF", 1000)
    monkeypatch.setattr(exact_disk, "LOAD", 64)
    monkeypatch.setattr(exact_disk, "READ", 300)


def files_of(scenario, out: Path, spilled: bool, steps: str) -> dict[str, bytes]:
    if spilled:
        spill = streamed.RecordSpill(out / streamed.FOLDER)
        result = predict(scenario, "run", spill=spill)
        assert result.requests is None
        streamed.write_spilled_files(result, spill, out, steps)
        assert len(spill.request_chunks) > 5 and all(len(c) > 1 for c in spill.step_chunks.values()), spill.step_chunks
    else:
        write_data_files(predict(scenario, "run"), out, steps)
    return {name: (out / name).read_bytes() for name in ("summary.json", "requests.csv", "steps.csv")}


@pytest.mark.parametrize("extra,steps", [
    ((), "aggregated"),
    ((), "timeline"),
    # a small KV pool: preemptions (requests emitting in several runs), multi-turn conversations
    # and a rejection (a prompt over max_model_len)
    (("engine.num_blocks=120", "engine.max_model_len=600", "workload.prompt_len.max=700",
      "workload.multi_turn.turns.dist=uniform", "workload.multi_turn.turns.min=1",
      "workload.multi_turn.turns.max=3", "workload.multi_turn.user_len.dist=fixed",
      "workload.multi_turn.user_len.value=20", "workload.multi_turn.think_time_s=0.5",
      "workload.arrival.rate=150"), "full"),
    # a CPU tier for the KV cache: its summary shares count every request's prompt tokens
    (("engine.num_blocks=400", "engine.kv_offload.backend=native", "engine.kv_offload.size_gib=1",
      "workload.num_requests=1500"), "aggregated"),
    # vLLM V0: tokens delivered after the next step's host work (StepRecorder.token_times)
    (("engine.vllm_version=0.7.3", "workload.num_requests=1500"), "aggregated"),
    # ... and to an in-process client when its asyncio loop wakes (StepRecorder.loop_wakes)
    (("engine.vllm_version=0.7.3", "engine.client_in_process=true", "workload.num_requests=1500"), "aggregated"),
    # the API server's loop streaming the steps' outputs in rounds (StepRecorder.delivered), pooled over the replicas
    (("engine.front_end_s=0.002", "engine.front_end_token_s=0.00005", "engine.front_end_step_s=0.0002",
      "workload.num_requests=1500"), "aggregated"),
])
def test_spilled_run_writes_the_in_memory_files_byte_for_byte(tmp_path, small_chunks, extra, steps):
    scenario = fleet(*extra)
    kept = files_of(scenario, tmp_path / "memory", False, steps)
    spilled = files_of(scenario, tmp_path / "spilled", True, steps)
    summary = json.loads(kept["summary.json"])
    assert summary["requests_finished"] > 0 and len(summary["replicas"]) == 4
    if "engine.max_model_len=600" in extra:
        assert summary["preemptions"] > 0 and summary["requests_rejected"] > 0
    if "engine.kv_offload.backend=native" in extra:
        assert summary["kv_offload"]["cpu_hit_rate"] > 0
    for name in kept:
        assert spilled[name] == kept[name], name


def test_spilling_refuses_a_disaggregated_or_autoscaled_run():
    scenario = load_scenario(ROOT / "scenarios" / "whatif_disaggregation.yaml")
    with pytest.raises(UserError, match="cluster.disaggregation"):
        streamed.check_spillable(scenario)


@pytest.mark.parametrize("flags,message", [
    (["--set", "workload.arrival.rate=100,200", "--no-plots"], "applies to one run"),
    ([], "add --no-plots"),
    (["--no-plots", "--trace"], "leave out --trace"),
])
def test_spill_records_names_what_it_cannot_do(tmp_path, capsys, flags, message):
    from sim.cli import main

    code = main([str(ROOT / "scenarios" / "fleet_64.yaml"), "--out", str(tmp_path / "out"), "--spill-records",
                 *flags])
    assert code == 2 and message in capsys.readouterr().err


def test_simrun_spill_records_writes_the_data_files_and_the_chunks(tmp_path):
    from sim.cli import main

    out = tmp_path / "out"
    assert main([str(ROOT / "scenarios" / "fleet_64.yaml"), "--set", "workload.num_requests=500",
                 "--set", "cluster.replicas=2", "--out", str(out), "--spill-records", "--no-plots", "--quiet"]) == 0
    assert {p.name for p in out.iterdir()} >= {"summary.json", "requests.csv", "steps.csv", "manifest.json", "records"}
    assert json.loads((out / "summary.json").read_text())["requests_total"] == 500
    assert sorted(p.name for p in (out / "records").glob("*.npz"))[:2] == ["requests-000000.npz",
                                                                          "steps-0000-000000.npz"]


def test_the_workload_lists_its_draws_in_chunks_and_makes_the_same_requests(monkeypatch):
    import sim.workload as workload
    from sim.predict import workload_digest

    scenario = load_scenario(ROOT / "scenarios" / "whatif_routers.yaml", ["workload.num_requests=300"])
    whole = workload_digest(workload.build_requests(scenario))
    monkeypatch.setattr(workload, "LISTED_CHUNK", 7)       # conversations straddle the chunks
    assert workload_digest(workload.build_requests(scenario)) == whole
