"""Runs in which nothing finishes: every request rejected exits non-zero with the reasons;
warm-up requests are not counted as finished."""
from __future__ import annotations

import json

from sim.cli import main

from support import SMALL


def test_run_where_every_request_is_rejected_exits_non_zero_with_reasons(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 64}\n"
                    "workload: {num_requests: 5, prompt_len: 100, output_len: 4}\n")
    assert main([str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "no request finished" in err
    assert "5 x prompt of N tokens leaves no room for output within max_model_len N" in err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["requests_rejected"] == 5 and summary["requests_finished"] == 0


def test_warmup_requests_are_not_counted_as_finished(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("num_requests: 4", "num_requests: 6, warmup_requests: 2"))
    assert main([str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["requests_total"] == 6 and summary["warmup_requests"] == 2
    assert summary["requests_finished"] == 4 == summary["requests_measured"]


def test_rejection_reasons_count_the_requests_that_requests_rejected_counts(tmp_path, capsys):
    """Warm-up requests are out of every figure: rejection_reasons, and the printed 'N requests not
    served (each counted as an SLO miss)', count the rejected requests that requests_rejected and
    the SLO attainment count. (Both counted 3 here: the 2 warm-up rejections too; found by h/audit2.)"""
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 64}\n"
                    "slo: {ttft_s: 10}\nworkload: {warmup_requests: 2, requests: [\n"
                    + "".join(f"  {{arrival_s: {i}, prompt_len: {n}, output_len: 4}},\n"
                              for i, n in enumerate([100, 100, 10, 10, 100])) + "]}\n")
    for spill in ([], ["--no-plots", "--spill-records"]):
        assert main([str(path), "--out", str(tmp_path / "o"), "--force", *spill]) == 0
        summary = json.loads((tmp_path / "o" / "summary.json").read_text())
        assert summary["requests_rejected"] == 1 and summary["slo_attainment"] == 2 / 3
        assert sum(r["count"] for r in summary["rejection_reasons"]) == 1, summary["rejection_reasons"]
        out = capsys.readouterr().out
        assert spill or "1 request not served (each counted as an SLO miss)" in out, out
