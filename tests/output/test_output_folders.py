"""Output folders kvtwin owns: stale and foreign files, markers it cannot be tricked by, runs
interrupted while writing, and the folders of validate, bench and compare (checked before measuring)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.cli import main

from support import NO_PREFIX, SMALL, SMOKE, vllm_result_file


def small_scenario(tmp_path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


def test_rerun_removes_stale_files_of_the_earlier_run(tmp_path):
    from sim.output.run_dir import INCOMPLETE, MARKER

    out = tmp_path / "out"
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--trace", "--quiet"]) == 0
    assert (out / "trace.json").exists() and (out / MARKER).exists() and not (out / INCOMPLETE).exists()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 0
    assert not (out / "trace.json").exists()          # stale: this run did not ask for a trace
    assert (out / "summary.json").exists()
    assert not [p for p in out.rglob("*.tmp")]


def test_folder_with_foreign_files_is_refused_before_simulating(tmp_path, capsys, monkeypatch):
    import sim.predict

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(sim.predict, "predict", lambda *a, **k: pytest.fail("simulated before checking --out"))
    assert main([str(small_scenario(tmp_path)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "--force" in err
    monkeypatch.undo()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--force", "--quiet"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "summary.json").exists()
    # a second forced run still leaves the foreign file alone
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--force", "--quiet"]) == 0
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("bad", ["", "  "])
def test_empty_out_is_refused(tmp_path, capsys, bad, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([str(small_scenario(tmp_path)), "--out", bad])
    assert exc.value.code == 2 and "empty path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.yaml"]


def test_out_that_is_a_file_is_refused_before_simulating(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("x")
    assert main([str(small_scenario(tmp_path)), "--out", str(target)]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main([str(small_scenario(tmp_path)), "--out", str(target / "sub")]) == 2


def test_interrupted_run_leaves_incomplete_and_the_next_run_cleans_up(tmp_path, monkeypatch):
    import sim.output.run_files as run_files
    from sim.output.run_dir import INCOMPLETE

    out = tmp_path / "out"
    real = run_files.write_csv

    def dies_midway(path, frame):
        if Path(path).name == "steps.csv":
            (Path(path).parent / ".steps.csv.abc.tmp").write_text("half")    # what kill -9 leaves
            raise KeyboardInterrupt
        return real(path, frame)

    monkeypatch.setattr(run_files, "write_csv", dies_midway)
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 130
    assert (out / INCOMPLETE).exists() and (out / "summary.json").exists()
    monkeypatch.undo()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 0
    assert not (out / INCOMPLETE).exists() and not list(out.glob(".*.tmp"))


def test_summary_json_is_valid_json_without_nan(tmp_path):
    from sim.output.io import write_json

    path = write_json(tmp_path / "s.json", {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_a_sweep_folder_inside_a_run_folder_is_left_alone(tmp_path):
    out = tmp_path / "runs" / "small"
    scenario = small_scenario(tmp_path)
    assert main([str(scenario), "--out", str(out), "--quiet"]) == 0
    assert main([str(scenario), "--out", str(out / "sweep"), "--quiet", "--set", "engine.block_size=8,16"]) == 0
    assert (out / "sweep" / "sweep.csv").exists()
    assert main([str(scenario), "--out", str(out), "--quiet"]) == 0       # the sweep is not foreign
    assert (out / "sweep" / "sweep.csv").exists()                          # nor stale


def test_a_crafted_marker_cannot_make_kvtwin_delete_outside_its_folder(tmp_path):
    from sim.output.run_dir import MARKER

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"kvtwin": "run folder", "files": ["../victim.txt", str(victim)]}))
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 0
    assert victim.read_text() == "keep me"


def test_hidden_temp_files_in_a_foreign_folder_are_not_ours(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mine.tmp").write_text("user's")
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 2
    for _ in range(2):          # and a second forced run still knows it is the user's
        assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet", "--force"]) == 0
        assert (out / ".mine.tmp").read_text() == "user's"


def test_validate_refuses_a_foreign_folder_before_measuring(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    import validate.run

    monkeypatch.setattr(validate.run, "validate", lambda *a, **k: pytest.fail("measured before checking --out"))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["validate", str(small_scenario(tmp_path)), "--device", "cpu", "--out", str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err


def test_compare_owns_its_output_folder(tmp_path, capsys, monkeypatch):
    from sim.output.run_dir import INCOMPLETE, MARKER

    single, sweep = vllm_result_file(tmp_path), vllm_result_file(tmp_path, (5.0, 20.0))
    out = tmp_path / "cmp"
    args = ["compare", str(SMOKE), *NO_PREFIX, "--out", str(out), "--allow-mismatch", "--vllm-result"]
    assert main([*args, str(sweep)]) == 0
    assert (out / "sweep_comparison.csv").exists() and (out / MARKER).exists() and not (out / INCOMPLETE).exists()
    assert main([*args, str(single)]) == 0
    assert (out / "comparison.csv").exists() and (out / "predicted" / "summary.json").exists()
    assert not (out / "sweep_comparison.csv").exists()          # the earlier run's files are gone
    assert not (out / INCOMPLETE).exists()
    # a folder of someone else's is refused before anything is predicted; --force writes beside it
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    import sim.predict

    real_predict = sim.predict.predict
    monkeypatch.setattr(sim.predict, "predict", lambda *a, **k: pytest.fail("predicted before checking --out"))
    capsys.readouterr()
    for result in (single, sweep):
        assert main(["compare", str(SMOKE), *NO_PREFIX, "--out", str(mine), "--vllm-result", str(result)]) == 2
        err = capsys.readouterr().err
        assert "notes.txt" in err and "--force" in err
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(SMOKE), "--out", "", "--vllm-result", str(single)])
    assert exit_.value.code == 2 and "an empty path" in capsys.readouterr().err
    monkeypatch.setattr(sim.predict, "predict", real_predict)
    assert main(["compare", str(SMOKE), *NO_PREFIX, "--out", str(mine), "--force", "--allow-mismatch",
                 "--vllm-result", str(single)]) == 0
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "comparison.csv").exists()


def test_bench_checks_its_output_folder_before_measuring_and_marks_a_failed_run(tmp_path, capsys, monkeypatch):
    import validate.bench_cli as bench_cli
    from sim.output.run_dir import INCOMPLETE

    monkeypatch.setattr(bench_cli, "run_bench", lambda *a, **k: pytest.fail("measured before checking --out"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    bench = ["bench", str(SMOKE), "--endpoint", "http://127.0.0.1:9"]
    assert main([*bench, "--out", str(mine)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([*bench, "--out", " "])
    assert exit_.value.code == 2 and "an empty path" in capsys.readouterr().err

    # measured, then killed while writing: the folder says so, and the next bench cleans it up
    monkeypatch.setattr(bench_cli, "run_bench", lambda *a, **k: object())

    def write_then_fail(predicted, measured, out, title):
        (out / "comparison.csv").write_text("partial")
        raise OSError("disk full")

    monkeypatch.setattr(bench_cli, "write_comparison", write_then_fail)
    out = tmp_path / "b"
    assert main([*bench, "--out", str(out)]) == 2
    assert (out / INCOMPLETE).exists() and (out / "comparison.csv").exists()
    monkeypatch.setattr(bench_cli, "write_comparison", lambda *a: (_ for _ in ()).throw(OSError("again")))
    assert main([*bench, "--out", str(out)]) == 2
    assert (out / INCOMPLETE).exists() and not (out / "comparison.csv").exists()


def test_force_never_writes_through_a_link_to_a_folder_outside_out(tmp_path, capsys):
    """--force writes beside foreign files, but a foreign link named like a variant's folder
    must not carry the variant's files outside --out."""
    scenario = tmp_path / "variants.yaml"
    scenario.write_text(SMALL + "variants:\n  a: {seed: 1}\n  b: {seed: 2}\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").symlink_to(outside)
    code = main([str(scenario), "--out", str(out), "--force", "--quiet", "--no-plots"])
    assert code == 2 and list(outside.iterdir()) == []
    err = capsys.readouterr().err
    assert f"{out / 'a'}" in err and "outside the output folder" in err, err


def test_spilled_records_never_go_through_a_link_outside_out(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "records").symlink_to(outside)
    code = main([str(small_scenario(tmp_path)), "--out", str(out), "--force", "--quiet", "--no-plots",
                 "--spill-records"])
    assert code == 2 and list(outside.iterdir()) == []
    assert "outside the output folder" in capsys.readouterr().err


def test_a_foreign_file_beside_a_kvtwin_run_is_not_blamed_on_an_old_kvtwin(tmp_path, capsys):
    """The hint '(a run of a kvtwin without output markers?)' is for a folder with a manifest.json
    and no marker; beside a marked run a foreign file is just that (found by h/audit2)."""
    out = tmp_path / "out"
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet", "--no-plots"]) == 0
    (out / "notes.txt").write_text("mine")
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "holds files kvtwin did not write (notes.txt)" in err and "without output markers" not in err, err
    (out / ".kvtwin-run").unlink()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet", "--no-plots"]) == 2
    assert "without output markers" in capsys.readouterr().err


def test_spilled_scratch_files_never_write_through_a_link(tmp_path):
    """A --spill-records run's scratch columns (records/*.bin) and cumulated step times
    (records/times-*.npy) are files it writes too: a foreign link named like one, kept by
    --force, is replaced, never written through (its target keeps its bytes)."""
    out = tmp_path / "out"
    (out / "records").mkdir(parents=True)
    victims = {name: tmp_path / f"victim-{name}" for name in ("steps-duration.bin", "times-0000-end_s.npy")}
    for name, victim in victims.items():
        victim.write_text("not kvtwin's")
        (out / "records" / name).symlink_to(victim)
    code = main([str(small_scenario(tmp_path)), "--out", str(out), "--force", "--quiet", "--no-plots",
                 "--spill-records"])
    assert code == 0
    assert [v.read_text() for v in victims.values()] == ["not kvtwin's"] * 2
    assert not (out / "records" / "times-0000-end_s.npy").is_symlink()
