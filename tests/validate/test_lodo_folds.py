"""validate.lodo's accounting of its folds: every fold gives back one row per run of its
deployment, or the refit stops with an error naming it. A refit once crashed deep in pandas
(`TypeError: 'NoneType' object is not iterable` in lodo_table) with a fold's rows come back as
None from its forked process, and no word of which fold. Synthetic folds: nothing is simulated."""
import json
import os
import signal

import pytest

from validate import lodo

V1 = ("Qwen/Qwen2.5-0.5B-Instruct / L4 / tp 1 / vLLM 0.23.0", "Qwen/Qwen3-32B / H100-SXM-80GB / tp 1 / vLLM 0.11.0")


def fake_runs() -> list:
    """Two runs of each V1 deployment, none through an API server (no front-end profile to fit)."""
    return [lodo.Run(id=f"{name} #{i}", deployment=name, gpu_class="l4", scenario=None, requests=[], measured={},
                     source="test", api_server=False) for name in V1 for i in range(2)]


@pytest.fixture
def folds(monkeypatch):
    """lodo_table over fake_runs with `_fold_rows` replaced by rows(name); its shared state kept apart."""
    monkeypatch.setattr(lodo, "_FOLD_STATE", {})
    runs = fake_runs()

    def table(rows, jobs):
        monkeypatch.setattr(lodo, "_fold_rows", rows)
        return lodo.lodo_table(runs, {}, progress=lambda *_: None, jobs=jobs)
    return table


@pytest.fixture
def deadline():
    """A map that waits forever for a result fails here instead (multiprocessing.Pool's did)."""
    def expired(*_):
        raise TimeoutError("the fold map waited for a result that never came")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def rows_of(name: str) -> list[dict]:
    return [{"run": f"{name} #{i}", "deployment": name} for i in range(2)]


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_table_has_one_row_per_run_in_run_order_whether_forked_or_not(folds, jobs):
    table = folds(rows_of, jobs)
    assert list(table["run"]) == [r.id for r in fake_runs()]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_fold_that_comes_back_as_none_is_named_not_passed_to_pandas(folds, jobs, deadline):
    with pytest.raises(lodo.FitError, match=r"1 of 2 folds failed[\s\S]*fold Qwen/Qwen3-32B .*: gave back None"):
        folds(lambda name: None if name == V1[1] else rows_of(name), jobs)


@pytest.mark.parametrize("rows, said", [(lambda name: rows_of(name)[:1], "1 rows for its 2 runs"),
                                        (lambda name: {"run": name}, "gave back {'run'")])
def test_a_fold_with_rows_missing_or_not_a_list_of_rows_is_named(folds, rows, said):
    with pytest.raises(lodo.FitError, match=f"fold {V1[0]}.*{said}"):
        folds(rows, 2)


def test_a_fold_whose_process_was_killed_is_named_after_the_others_finish(folds, deadline):
    """The out-of-memory killer's SIGKILL: the process gives back nothing (Pool.map hung on it)."""
    def rows(name):
        if name == V1[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        return rows_of(name)

    with pytest.raises(lodo.FitError, match=rf"1 of 2 folds failed[\s\S]*fold {V1[0]}: its process ended "
                                            r"\(exit code -9: killed"):
        folds(rows, 2)


def test_a_fold_that_raised_in_its_process_is_named_with_its_traceback(folds, deadline):
    def rows(name):
        raise ZeroDivisionError(f"no runs to fit for {name}")

    with pytest.raises(lodo.FitError, match=r"2 of 2 folds failed") as failed:
        folds(rows, 2)
    for name in V1:
        assert f"fold {name}: Traceback" in str(failed.value) and f"no runs to fit for {name}" in str(failed.value)


def test_a_fold_that_raised_here_keeps_its_error_and_names_the_fold(folds):
    def rows(name):
        raise ZeroDivisionError("no runs")

    with pytest.raises(ZeroDivisionError) as raised:
        folds(rows, 1)
    assert raised.value.__notes__ == [f"in fold {V1[0]}"]


def test_a_kept_fit_with_no_value_is_refused_naming_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(lodo, "_FOLD_STATE", {"resume": tmp_path})
    assert lodo._resumable("fold", V1[0], lambda: rows_of(V1[0]), "v1") == rows_of(V1[0])
    (kept,) = tmp_path.glob("fold-*.json")
    kept.write_text(json.dumps({"name": V1[0], "value": None}))
    with pytest.raises(lodo.FitError, match=f"{kept.name}: fold .*kept with no value"):
        lodo._resumable("fold", V1[0], lambda: rows_of(V1[0]), "v1")
