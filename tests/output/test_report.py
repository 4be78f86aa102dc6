"""Report: plots, the HTML page and the Perfetto trace, over real (small) simulated runs."""
import gzip
import json
from collections import Counter, defaultdict

import numpy as np
import pandas as pd
import pytest

from sim.metrics import summarise
from sim.records import requests_frame
from sim.output import units
from sim.output import views as report_views
from sim.output.report import (CDF_POINTS, PLOTS, RunView, cdf_points, format_value, plot_latency_cdf,
                        plot_run_figures, summary_table, timeline, write_html_report,
                        write_perfetto_trace)
from sim.scenario import validate_scenario
from sim.simulator import simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulated_view(label, engine=None, workload=None, cluster=None):
    scenario = validate_scenario({
        "model": "qwen2.5-0.5b", "device": "h100-sxm",
        "engine": {"max_model_len": 1024, "num_blocks": 400, **(engine or {})},
        "workload": {"num_requests": 80, "warmup_requests": 10, "arrival": {"process": "poisson", "rate": 40},
                     "prompt_len": {"dist": "uniform", "min": 32, "max": 400},
                     "output_len": {"dist": "uniform", "min": 1, "max": 200}, **(workload or {})},
        "cluster": cluster or {}})
    records, _, _ = simulate(scenario)
    requests, steps = requests_frame(records), records.steps_frame()
    summary = summarise(records, scenario.slo, requests, steps)
    return RunView.from_records(label, records, summary, requests, steps)


@pytest.fixture(scope="module")
def views():
    return {"continuous": simulated_view("continuous"),
            "static": simulated_view("static", engine={"batching": "static"})}


@pytest.fixture(scope="module")
def rejected():
    # every prompt is longer than max_model_len: no request is admitted, no step runs
    view = simulated_view("rejected", workload={"num_requests": 5, "warmup_requests": 0, "prompt_len": 2000})
    assert (view.requests["status"] == "rejected").all() and view.steps.empty
    return view


@pytest.fixture(scope="module")
def two_replicas():
    return simulated_view("two replicas", cluster={"replicas": 2})


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, path


# ----------------------------------------------------------------------------- downsampling

def synthetic_steps(start_s, values, replica=0, dur_s=1e-3):
    start_s = np.asarray(start_s, dtype=float)
    return pd.DataFrame({"replica": replica, "start_s": start_s, "end_s": start_s + dur_s,
                         "kv_blocks_used": np.asarray(values, dtype=float)})


def test_timeline_keeps_the_peak_of_a_long_run():
    rng = np.random.default_rng(0)
    used = rng.integers(100, 200, size=200_000)
    used[123_457] = 5_000                                    # one step's spike among 200k
    steps = synthetic_steps(np.arange(200_000) * 1e-3, used)
    edges, tl = timeline(steps, {"kv_blocks_used": "max"}, buckets=1000)
    assert len(tl) == 1000 and len(edges) == 1001
    assert tl["kv_blocks_used"].max() == 5_000
    assert tl["kv_blocks_used"].argmax() == np.searchsorted(edges, 123.457, side="right") - 1
    _, mean = timeline(steps, {"kv_blocks_used": "mean"}, buckets=1000)
    assert mean["kv_blocks_used"].max() < 5_000


def test_timeline_holds_values_between_steps_and_sums_replicas():
    steps = pd.concat([synthetic_steps([0.0, 9.0], [5, 7], replica=0, dur_s=1.0),
                       synthetic_steps([0.0], [3], replica=1, dur_s=10.0)])
    edges, tl = timeline(steps, {"kv_blocks_used": "max"}, buckets=10)
    np.testing.assert_allclose(edges, np.arange(11.0))
    assert tl["kv_blocks_used"].tolist() == [8.0] * 9 + [10.0]


def test_timeline_of_no_steps_is_empty(rejected):
    edges, tl = timeline(rejected.steps, {"kv_blocks_used": "max"})
    assert len(edges) == 0 and len(tl) == 0


def test_cdf_points_are_thinned_but_keep_both_ends():
    values = np.random.default_rng(1).exponential(size=50_000)
    x, p = cdf_points(values, points=500)
    assert len(x) == 500 and x[0] == values.min() and x[-1] == values.max()
    assert p[-1] == 1.0 and np.all(np.diff(p) > 0)


# ----------------------------------------------------------------------------- plots

@pytest.mark.parametrize("labels", [["continuous"], ["continuous", "static"]])
def test_plot_run_figures_writes_every_png(views, tmp_path, labels):
    figures = plot_run_figures({k: views[k] for k in labels}, tmp_path)
    assert set(figures) == set(PLOTS)
    for name, path in figures.items():
        assert path == tmp_path / f"{name}.png"
        assert_png(path)
    # written atomically: no temporary files left beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in PLOTS)


def test_latency_cdf_counts_only_finished_measured_requests(views):
    fig = plot_latency_cdf(views)
    ttft = fig.axes[0]
    for line, (label, view) in zip(ttft.get_lines(), views.items()):
        measured = view.summary["requests_measured"]
        assert measured == 70                                 # 80 requests less 10 warm-up
        assert line.get_label() == f"{label} (n={measured})"
        assert line.get_ydata()[-1] == 1.0 and len(line.get_xdata()) <= CDF_POINTS
        assert line.get_xdata()[-1] == pytest.approx(view.summary["ttft_s"]["max"] * 1e3)


def test_all_rejected_run_renders_everything(rejected, views, tmp_path):
    from sim.output.report import RUN_FIGURES

    for group in ({"rejected": rejected}, {"rejected": rejected, "continuous": views["continuous"]}):
        figures = plot_run_figures(group, tmp_path, "", RUN_FIGURES)      # the overview without a title too
        for path in figures.values():
            assert_png(path)
        page = write_html_report(tmp_path / "report.html", "all rejected", group, figures, {}).read_text()
        assert "<td>5</td>" in page                           # requests rejected
        trace = json.loads(write_perfetto_trace(tmp_path / "trace.json", group).read_text())
        instants = [e for e in trace["traceEvents"] if e["ph"] == "n" and e["pid"] == 1]
        assert len(instants) == 5 and instants[0]["name"] == "rejected"
        assert "2000" in instants[0]["args"]["reason"]


def test_multi_replica_plots_sum_over_replicas(two_replicas, tmp_path):
    fig = PLOTS["kv_blocks"]({"two": two_replicas})
    assert "sum over replicas" in fig.axes[0].get_ylabel()
    total_line = [ln for ln in fig.axes[1].get_lines() if "total" in ln.get_label()][0]
    assert total_line.get_ydata()[0] == 2 * two_replicas.kv_blocks_total


# ----------------------------------------------------------------------------- tables and HTML

def test_summary_table_rows_carry_units_and_display_scale(views, rejected):
    all_views = {**views, "rejected": rejected}
    numeric = summary_table(all_views, formatted=False)
    assert list(numeric.columns) == ["continuous", "static", "rejected"]
    s = views["static"].summary
    assert numeric.loc["TTFT p50 (ms)", "static"] == pytest.approx(s["ttft_s"]["p50"] * 1e3)
    assert numeric.loc["KV usage peak", "static"] == pytest.approx(s["kv_usage_peak"] * 100)
    queue_share = s["latency_split"]["queue"] * 100
    assert numeric.loc["latency split: queue", "static"] == pytest.approx(queue_share)
    text = summary_table(all_views)
    assert text.loc["request throughput (req/s)", "continuous"] == format_value(
        views["continuous"].summary["request_throughput"])
    assert text.loc["goodput (req/s)", "continuous"] == "—"          # no SLO set
    assert text.loc["request throughput (req/s)", "rejected"] == "—"
    assert text.loc["requests rejected", "rejected"] == "5"
    # shares carry their sign, so 0.38% never reads as 38%
    assert text.loc["KV usage peak", "static"] == units.pct(s["kv_usage_peak"])
    assert text.loc["KV usage peak", "static"].endswith("%")


def test_summary_table_ratio_columns_compare_each_run_with_the_first(views):
    table = summary_table(views, ratios=True)
    assert list(table.columns) == ["continuous", "static", "static / continuous"]
    c, s = views["continuous"].summary, views["static"].summary
    expected = s["request_throughput"] / c["request_throughput"]
    assert table.loc["request throughput (req/s)", "static / continuous"] == units.ratio(expected)
    assert list(summary_table(views).columns) == ["continuous", "static"]


@pytest.mark.parametrize("value, kind, text", [
    (0.0038, "pct", "0.38%"), (0.477, "pct", "47.7%"), (1.0, "pct", "100%"), (0.031, "signed_pct", "+3.1%"),
    (0.9996, "pct", "99.96%"), (0.99997, "pct", "99.997%"), (0.9994, "pct", "99.9%"),   # never "100.0%" below 1
    (-0.12, "signed_pct", "-12.0%"), (0.00186, "ms", "1.86"), (1.0889, "ms", "1,089"),
    (988065536, "gib", "0.92 GiB"), (73804677120, "gib", "68.7 GiB"), (13213, "count", "13,213"),
    (1.93, "ratio", "1.93x"), (1.0, "ratio", "1.00x"), (0.0348, "ratio", "0.035x"), (None, "ms", "—"), (float("nan"), "pct", "—"),
])
def test_one_unit_system(value, kind, text):
    assert units.display(value, kind) == text


@pytest.mark.parametrize("value, text", [
    (None, "—"), (float("nan"), "—"), (375389, "375,389"), (4048.06, "4,048"), (236.84, "236.8"),
    (19.2554, "19.26"), (0.000639, "0.000639"), (-3.25, "-3.25"), (np.int64(7), "7"), ("static", "static"),
])
def test_format_value(value, text):
    assert format_value(value) == text


def test_html_report_is_one_self_contained_escaped_page(views, tmp_path):
    figures = plot_run_figures(views, tmp_path)
    extra = pd.DataFrame({"predicted": [1.5, 2.0], "measured": [1.6, 2.1], "error (%)": [-6.25, -4.76]},
                         index=pd.Index(["TTFT p50 (ms)", "TPOT p50 (ms)"], name="metric"))
    manifest = {"note": "<script>alert(1)</script>", "seed": 0}
    path = write_html_report(tmp_path / "report.html", "continuous vs static <b>", views, figures, manifest,
                             extra_tables=[("predicted vs measured & errors", extra)])
    page = path.read_text()
    for label, view in views.items():
        assert f"<th>{label}</th>" in page
        assert f"<td>{format_value(view.summary['request_throughput'])}</td>" in page
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "continuous vs static &lt;b&gt;" in page and "predicted vs measured &amp; errors" in page
    assert "<td>-6.25</td>" in page and '<td class="label">TTFT p50 (ms)</td>' in page
    assert "<details><summary>Manifest</summary>" in page
    assert "http://" not in page and "https://" not in page          # nothing external to load


def test_html_report_flags_an_uncalibrated_prediction(views, tmp_path):
    view = views["continuous"]
    flagged = RunView(view.label, {**view.summary, "calibrated": False}, view.requests, view.steps,
                      view.kv_blocks_total)
    page = write_html_report(tmp_path / "r.html", "t", {"p": flagged}, {}, {}).read_text()
    assert 'class="warning">Uncalibrated cost model (p)' in page


# ----------------------------------------------------------------------------- trace

def load_trace(path):
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def assert_async_slices_nest(events):
    """Per (pid, id): b/e pairs match by name, nest properly and never run backwards."""
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] in "be":
            tracks[(e["pid"], e["id"])].append(e)
    for track in tracks.values():
        stack, last = [], -np.inf
        for e in track:
            assert e["ts"] >= last
            last = e["ts"]
            if e["ph"] == "b":
                stack.append(e["name"])
            else:
                assert stack.pop() == e["name"]
        assert not stack
    return tracks


def test_perfetto_trace_has_steps_counters_and_request_slices(views, two_replicas, tmp_path):
    all_views = {**views, "two replicas": two_replicas}
    trace = load_trace(write_perfetto_trace(tmp_path / "trace.json", all_views))
    events = trace["traceEvents"]
    for pid, view in enumerate(all_views.values(), start=1):
        mine = [e for e in events if e.get("pid") == pid]
        steps = [e for e in mine if e["ph"] == "X"]
        assert len(steps) == len(view.steps)
        assert Counter(e["tid"] for e in steps) == Counter((view.steps["replica"] + 1).tolist())
        first = view.steps.iloc[0]
        assert steps[0]["name"] == f"step {int(first['step'])}"
        assert steps[0]["ts"] == pytest.approx(first["start_s"] * 1e6)
        assert steps[0]["dur"] == pytest.approx((first["end_s"] - first["start_s"]) * 1e6)
        assert set(steps[0]["args"]) == {"decode_seqs", "prefill_tokens", "kv_blocks_used", "preemptions"}
        counters = {e["name"] for e in mine if e["ph"] == "C"}
        expected = {"kv_blocks_used", "running", "waiting"}
        if view.replicas > 1:
            expected = {f"{c} r{r}" for c in expected for r in range(view.replicas)}
        assert counters == expected
        tracks = assert_async_slices_nest(mine)
        finished = int((view.requests["status"] == "finished").sum())
        assert len(tracks) == finished
        assert all([e["name"] for e in t if e["ph"] == "b"][1:] == ["queue", "prefill", "decode"]
                   for t in tracks.values())
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == set(all_views)
    # The peak kv counter equals the summary's peak (counters are emitted on every change).
    kv = [e["args"]["value"] for e in events if e["pid"] == 1 and e.get("name") == "kv_blocks_used"]
    assert max(kv) == views["continuous"].summary["kv_blocks_peak"]


def test_perfetto_trace_caps_request_slices_and_says_so(views, tmp_path):
    trace = load_trace(write_perfetto_trace(tmp_path / "trace.json.gz", views, max_requests=10))
    tracks = assert_async_slices_nest(trace["traceEvents"])
    assert Counter(pid for pid, _ in tracks) == {1: 10, 2: 10}
    # the first ten arrivals are requests 0-9 (arrivals are in id order)
    assert {rid for pid, rid in tracks if pid == 1} == {f"1:{i}" for i in range(10)}
    assert trace["otherData"]["request_slices"]["static"] == "first 10 of 80 requests by arrival"


@pytest.mark.parametrize("processes", [0, 1, 2])
def test_figure_workers_draw_every_run_plot(views, tmp_path, processes):
    from sim.output.png import read_png
    from sim.output.report import RUN_FIGURES
    from sim.output.workers import FigureWorkers, can_fork_here, run_plot_names

    assert run_plot_names() == list(RUN_FIGURES)
    forks = processes > 0 and can_fork_here()     # not with other threads (pytest-xdist's worker)
    with FigureWorkers(processes) as workers:
        assert (workers.pool is not None) == forks
        drawn = workers.draw(views, tmp_path / "here", "continuous vs static: qwen2.5-0.5b on h100-sxm")
    assert list(drawn) == list(RUN_FIGURES)
    assert all(p.stat().st_size > 10_000 for p in drawn.values())
    # the overview, made of panels drawn by other processes, is the one a single process makes
    alone = plot_run_figures(views, tmp_path / "alone", "continuous vs static: qwen2.5-0.5b on h100-sxm",
                             RUN_FIGURES)
    assert np.array_equal(read_png(drawn["overview"])[0], read_png(alone["overview"])[0])


def test_histogram_on_even_edges_counts_as_numpy_does_on_the_edges():
    """views.histogram bins evenly spaced edges by their number and range (no sort): the counts of
    np.histogram on the edges themselves, values on an edge included; other edges as given."""
    from sim.output.views import histogram

    rng = np.random.default_rng(7)
    samples = [rng.exponential(80.0, 5000), np.round(rng.random(3000) * 50, 1), np.full(40, 12.5),
               rng.random(1) * 3]
    for values in samples:
        edges = np.histogram_bin_edges(np.array([values.min(), values.max()]), bins=60)
        for sample in (values, np.concatenate([values, edges, edges[:-1] + np.spacing(edges[:-1])])):
            assert np.array_equal(histogram(sample, edges), np.histogram(sample, edges)[0])
    uneven = np.array([0.0, 1.0, 10.0, 100.0])
    values = np.array([0.5, 1.0, 5.0, 99.0, 100.0, 150.0])
    assert histogram(values, uneven).tolist() == [1, 2, 2]


def test_gc_paused_restores_the_collector_as_it_was():
    import gc

    from sim.core.collector import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()          # a caller's choice is kept
    finally:
        gc.enable()


def test_figure_process_start_leaves_3d_importable_and_warns_nothing():
    """The figure process imports matplotlib without its 3D toolkit, silently, and leaves the
    toolkit importable and the collector on (a fresh process: this one has matplotlib already)."""
    import subprocess
    import sys

    code = ("import gc, sys\n"
            "from sim.output.workers import figure_process_start\n"
            "figure_process_start()\n"
            "assert 'mpl_toolkits.mplot3d' not in sys.modules and gc.isenabled()\n"
            "from matplotlib.projections import get_projection_names\n"
            "assert '3d' not in get_projection_names()\n"
            "import mpl_toolkits.mplot3d\n"
            # a module the figures never read is imported but not run (a lazy module's type), and
            # runs when read (an import statement reads it too)
            "import types\n"
            "assert type(sys.modules['fontTools.agl']) is not types.ModuleType\n"
            "assert sys.modules['fontTools.agl'].toUnicode('A') == 'A'\n"
            "assert type(sys.modules['fontTools.agl']) is types.ModuleType\n")
    from pathlib import Path

    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and not done.stderr, done.stderr


def test_a_font_made_in_memory_draws_the_same_glyphs_and_only_within():
    """workers.fonts_made_in_memory (warm_up makes the figures' font there): FT2Font given a path
    is made from the file's bytes in memory, not read through a file object as FreeType asks, and
    lays out and renders a text to the same pixels; FT2Font is matplotlib's own again outside."""
    from matplotlib import ft2font
    from matplotlib.font_manager import FontProperties, findfont

    from sim.output.workers import fonts_made_in_memory

    path = findfont(FontProperties())
    with fonts_made_in_memory():
        in_memory = ft2font.FT2Font(path)
    from_file = ft2font.FT2Font(path)
    assert isinstance(ft2font.FT2Font, type) and type(in_memory) is ft2font.FT2Font
    assert hasattr(in_memory.fname, "getbuffer") and not hasattr(from_file.fname, "getbuffer")   # (bytes in memory)
    assert in_memory.family_name == from_file.family_name
    for font in (in_memory, from_file):
        font.set_size(11, 110)
        font.set_text("Tokens per step (10k), p99 TTFT", 0.0)
        font.draw_glyphs_to_bitmap()
    assert in_memory.get_width_height() == from_file.get_width_height()
    assert np.array_equal(np.asarray(in_memory.get_image()), np.asarray(from_file.get_image()))


def test_imported_lazily_runs_a_module_when_first_read_and_only_within(tmp_path, monkeypatch):
    import importlib
    import sys

    from sim.output.workers import imported_lazily

    for name in ("lazy_probe_a", "lazy_probe_b"):
        (tmp_path / f"{name}.py").write_text("import pathlib\n"
                                             "pathlib.Path(__file__).with_suffix('.ran').touch()\n"
                                             "VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        with imported_lazily(frozenset({"lazy_probe_a", "lazy_probe_b"})):
            import lazy_probe_a
        assert not (tmp_path / "lazy_probe_a.ran").exists()       # imported, not run
        assert lazy_probe_a.VALUE == 42 and (tmp_path / "lazy_probe_a.ran").exists()
        import lazy_probe_b                                       # outside: an ordinary import
        assert (tmp_path / "lazy_probe_b.ran").exists()
    finally:
        for name in ("lazy_probe_a", "lazy_probe_b"):
            sys.modules.pop(name, None)


def test_one_figure_process_by_default_and_a_bad_setting_is_named(monkeypatch):
    from sim.errors import UserError
    from sim.output.workers import figure_processes, plot_ways

    monkeypatch.delenv("KVTWIN_PLOT_WORKERS", raising=False)
    assert figure_processes() == 1 and plot_ways() == 2          # a sweep: its own process and one copy
    monkeypatch.setenv("KVTWIN_PLOT_WORKERS", "0")
    assert figure_processes() == 0 and plot_ways() == 1
    monkeypatch.setenv("KVTWIN_PLOT_WORKERS", "3")
    assert figure_processes() == 3 and plot_ways() == 4
    for bad in ("two", "-1", "1000", "\u00b2"):          # "²".isdigit() holds, int("²") fails
        monkeypatch.setenv("KVTWIN_PLOT_WORKERS", bad)
        with pytest.raises(UserError, match="KVTWIN_PLOT_WORKERS"):
            figure_processes()


def test_overview_leaves_out_cached_free_blocks_without_prefix_caching(views):
    from sim.output.report import plot_kv_blocks

    nocache = {k: RunView(v.label, v.summary, v.requests, v.steps.assign(kv_blocks_cached=0), v.kv_blocks_total)
               for k, v in views.items()}
    assert len(plot_kv_blocks(nocache).axes) == 1
    cached = {k: RunView(v.label, v.summary, v.requests, v.steps.assign(kv_blocks_cached=3), v.kv_blocks_total)
              for k, v in views.items()}
    assert len(plot_kv_blocks(cached).axes) == 2


def test_errors_chart_keeps_metric_names(tmp_path, monkeypatch):
    import validate.plots as plots

    table = pd.DataFrame({"relative_error": [0.05, -0.2], "tolerance": [0.1, None], "within": [True, None]},
                         index=pd.Index(["TTFT p50 (s)", "KV blocks peak"], name="metric"))
    figures = []
    real = plots.save_figure

    def keep(fig, path):
        figures.append(fig)
        return real(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    plots.plot_relative_errors(table, tmp_path / "errors.png")
    figures[0].canvas.draw()
    labels = [t.get_text() for t in figures[0].axes[0].get_yticklabels()]
    assert labels == ["TTFT p50 (ms)", "KV blocks peak"]          # names in display units, not 0, 1


def test_comparison_tables_show_display_units():
    from sim.output.pages import display_comparison, html_table

    table = pd.DataFrame({"predicted": [0.0123, 2.5 * 2**30, 0.42, 1234.0],
                          "measured": [0.0100, 2.0 * 2**30, 0.40, 1000.0],
                          "relative_error": [0.23, 0.25, 0.05, 0.234], "tolerance": [0.1, 0.02, None, None],
                          "within": [False, False, None, None]},
                         index=pd.Index(["TTFT p50 (s)", "peak device memory (bytes)", "prefix hit rate",
                                         "KV blocks peak"], name="metric"))
    shown = display_comparison(table)
    assert list(shown.index) == ["TTFT p50 (ms)", "peak device memory (GiB)", "prefix hit rate", "KV blocks peak"]
    assert list(shown.loc["TTFT p50 (ms)"]) == ["12.30", "10", "+23.0%", "±10.0%", "NO"]
    assert shown.loc["peak device memory (GiB)", "predicted"] == "2.5 GiB"
    assert shown.loc["prefix hit rate", "measured"] == "40.0%" and shown.loc["KV blocks peak", "predicted"] == "1,234"
    page = html_table(table)
    assert "<td>+23.0%</td>" in page and "e+09" not in page and "0.0123" not in page


def _pandas_timeline(steps, agg, buckets, combine="sum"):
    """The former groupby implementation of `timeline`, as the reference for the numpy one."""
    cols = list(agg)
    t0, t1 = float(steps["start_s"].min()), float(steps["end_s"].max())
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    bucket = np.minimum(((steps["start_s"].to_numpy() - t0) / width).astype(np.int64), buckets - 1)
    per = steps.groupby([steps["replica"].to_numpy(), bucket])[cols].agg(dict(agg))
    wide = per.unstack(0).reindex(range(buckets)).ffill().fillna(0.0)
    combined = wide.T.groupby(level=0).agg(combine).T
    return t0 + width * np.arange(buckets + 1), combined[cols]


@pytest.mark.parametrize("combine", ["sum", "mean", "max"])
def test_timeline_matches_the_groupby_reduction(combine):
    rng = np.random.default_rng(3)
    parts = []
    for replica in (2, 0, 1):              # replicas in any order; replica 1 starts late
        start = np.sort(rng.uniform(5.0 if replica == 1 else 0.0, 10.0, 3000))
        parts.append(pd.DataFrame({"replica": replica, "start_s": start, "end_s": start + 1e-3,
                                   "a": rng.integers(0, 100, len(start)), "b": rng.random(len(start))}))
    steps = pd.concat(parts, ignore_index=True)
    agg = {"a": "max", "b": "mean"}
    edges, got = timeline(steps, agg, buckets=700, combine=combine)
    ref_edges, ref = _pandas_timeline(steps, agg, 700, combine)
    assert np.array_equal(edges, ref_edges)
    assert np.allclose(got.to_numpy(), ref.to_numpy(), rtol=1e-12, atol=0)


def test_drawable_views_carry_the_plotted_reductions_only(views, two_replicas, tmp_path):
    """What a drawing process gets: no frames, every series the plots draw, the same figures."""
    import pickle

    from sim.output.report import RUN_FIGURES

    for view in (*views.values(), two_replicas):
        light = RunView(view.label, view.summary, view.requests, view.steps, view.kv_blocks_total,
                        view.replicas).drawable()
        assert light.steps is None and light.requests.empty
        assert len(pickle.dumps(light)) < len(pickle.dumps(view)) / 2
        for series in report_views.PLOT_SERIES:
            assert np.array_equal(light.series(*series)[1].to_numpy(), view.series(*series)[1].to_numpy())
        assert light.latency_cdf("ttft_s")[2] == len(view.measured["ttft_s"].dropna())
    # (drawable_views, as simrun sends them: the step-time histogram on the figure's bins, which a
    # view's own drawable() cannot know; run alone, this test caught the plain drawable() missing it)
    drawn = plot_run_figures(report_views.drawable_views(views), tmp_path, "light", RUN_FIGURES)
    assert set(drawn) == set(RUN_FIGURES)


# ----------------------------------------------------------------------------- files and tables without pandas

@pytest.mark.parametrize("alpha", [255, 128])
def test_png_writer_keeps_every_pixel(tmp_path, alpha):
    from PIL import Image

    from sim.output.png import write_png

    rgba = np.random.default_rng(0).integers(0, 256, (37, 53, 4), dtype=np.uint8)
    rgba[..., 3] = alpha
    rgba[10:20] = rgba[9]                                  # repeated rows: the Up filter's zeros
    with Image.open(write_png(tmp_path / "x.png", rgba, 110, "kvtwin")) as image:
        assert image.mode == ("RGB" if alpha == 255 else "RGBA")
        assert np.array_equal(np.asarray(image.convert("RGBA")), rgba)
        assert image.info["Software"] == "kvtwin" and round(image.info["dpi"][0]) == 110
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]     # written atomically


def test_png_reader_gives_back_what_the_writer_wrote(tmp_path):
    from sim.output.png import read_png, write_png

    rng = np.random.default_rng(1)
    for channels, alpha in ((4, 255), (4, 7), (3, None)):
        pixels = rng.integers(0, 256, (29, 41, channels), dtype=np.uint8)
        if alpha is not None:
            pixels[..., 3] = alpha
        got, texts = read_png(write_png(tmp_path / "x.png", pixels, 110, "kvtwin", {"kvtwin panels": "[[1,2,3,4]]"}))
        want = pixels[..., :3] if channels == 3 or alpha == 255 else pixels        # opaque: stored as RGB
        assert np.array_equal(got, want)
        assert texts == {"Software": "kvtwin", "kvtwin panels": "[[1,2,3,4]]"}
    (tmp_path / "y.png").write_bytes(b"GIF89a")
    with pytest.raises(ValueError, match="not a PNG"):
        read_png(tmp_path / "y.png")


def test_panel_boxes_hold_each_axes_labels_and_title_and_no_neighbour(views, tmp_path):
    """Each axes' box (what the overview cuts out) holds everything matplotlib drew for it (tick
    labels, axis labels, title, legend) and none of another axes' or the figure title."""
    from sim.output.report import DPI, figure_pixels, panel_boxes, titled

    for name, plot in PLOTS.items():
        fig = titled(plot(views), "continuous vs static: qwen2.5-0.5b on h100-sxm")
        fig.dpi = DPI                                   # (the renderer below measures at the PNG's dpi)
        pixels = figure_pixels(fig, DPI)
        height, width = pixels.shape[:2]
        boxes = panel_boxes(fig, height, width)
        renderer = fig.canvas.get_renderer()
        title, = (t.get_window_extent(renderer) for t in fig.findobj(match=lambda a: hasattr(a, "get_text"))
                  if t.get_text() == fig.get_suptitle())
        for ax, (left, top, right, bottom) in zip(fig.axes, boxes):
            tight = ax.get_tightbbox(renderer)          # display pixels from the bottom-left
            assert left <= tight.x0 and tight.x1 <= right + 1, name
            assert top <= height - tight.y1 and height - tight.y0 <= bottom + 1, name
            assert height - title.y0 <= top, name       # the figure title is left out
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], name


def test_the_overview_is_the_other_figures_panels_as_drawn(views, tmp_path):
    """overview.png holds the panels of OVERVIEW_GRID cut from the written figures, pixel for
    pixel (the same data, axes and labels as those figures), under the figure title."""
    from sim.output.png import read_png
    from sim.output.report import OVERVIEW_GRID, PANELS_TEXT, RUN_FIGURES

    drawn = plot_run_figures(views, tmp_path, "continuous vs static", RUN_FIGURES)
    overview, _ = read_png(drawn["overview"])
    figures = {name: read_png(drawn[name]) for name in PLOTS}
    first = json.loads(figures["kv_blocks"][1][PANELS_TEXT])[0]
    y = first[1]                                              # the title band's height
    assert np.array_equal(overview[:y, :figures["kv_blocks"][0].shape[1]].min(axis=(0, 1)), [0, 0, 0])  # text
    for row in OVERVIEW_GRID:
        x = 0
        for name, index in row:
            pixels, texts = figures[name]
            left, top, right, bottom = json.loads(texts[PANELS_TEXT])[index]
            panel = pixels[top:bottom, left:right, :3]
            assert np.array_equal(overview[y:y + len(panel), x:x + panel.shape[1]], panel), name
            x += panel.shape[1]
        y += max(json.loads(figures[n][1][PANELS_TEXT])[i][3] - json.loads(figures[n][1][PANELS_TEXT])[i][1]
                 for n, i in row)
    assert y == len(overview)


def test_summary_text_is_the_summary_table_cell_for_cell(views, rejected):
    from sim.output.pages import html_table, html_text_table, summary_text

    for group in ({**views, "rejected": rejected}, {"one": views["static"]}, {}):
        for ratios in (False, True):
            text, frame = summary_text(group, ratios), summary_table(group, ratios=ratios)
            assert text.frame().equals(frame)
            assert html_text_table(text) == html_table(frame)


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_ticks_are_made_only_inside_the_view_and_draw_the_same(scale):
    """InView: matplotlib makes no tick beyond the view (its locators give one or more at each
    end), and the figure's pixels are those of the plain locators."""
    from matplotlib.figure import Figure

    from sim.output.report import InView, figure_pixels, finish_axes

    def drawn(in_view):
        fig = Figure(figsize=(4, 3))
        ax = fig.subplots()
        ax.plot([0.7, 3, 40, 2e4], [5, 1, 2e3, 3])
        ax.set_xscale(scale)
        ax.set_ylim(0, 2100)                 # a tick on the view's edge (0) is kept
        finish_axes(ax, "t", "y", "x")
        if not in_view:
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(axis.get_major_locator().locator)
                axis.set_minor_locator(axis.get_minor_locator().locator)
        return ax, figure_pixels(fig, 50)

    ax, pixels = drawn(True)
    plain_ax, plain = drawn(False)
    assert isinstance(ax.xaxis.get_major_locator(), InView)
    for axis, plain_axis in ((ax.xaxis, plain_ax.xaxis), (ax.yaxis, plain_ax.yaxis)):
        low, high = sorted(axis.get_view_interval())
        for locs, plain_locs in ((axis.get_majorticklocs(), plain_axis.get_majorticklocs()),
                                 (axis.get_minorticklocs(), plain_axis.get_minorticklocs())):
            assert ((locs >= low) & (locs <= high)).all()
            assert list(locs) == [x for x in plain_locs if low <= x <= high]
        assert len(axis.get_major_ticks()) < len(plain_axis.get_major_ticks())
    assert ax.yaxis.get_majorticklocs()[0] == 0
    assert np.array_equal(pixels, plain)


def test_log_axes_label_decades_in_plain_text():
    from matplotlib.figure import Figure

    from sim.output.report import PlainLogFormatter, figure_pixels, finish_axes

    fig = Figure()
    ax = fig.subplots()
    ax.plot([1, 10, 1e5], [1, 2, 3])
    ax.set_xscale("log")
    finish_axes(ax, "t", "y", "x")
    assert isinstance(ax.xaxis.get_major_formatter(), PlainLogFormatter)
    figure_pixels(fig, 20)
    labels = {t.get_text() for t in ax.get_xticklabels() if t.get_text()}
    assert {"10⁰", "10¹", "10⁵"} <= labels and not any("$" in label for label in labels)


@pytest.mark.parametrize("low, high", [(1.0, 3e3), (20.0, 80.0)])
def test_minor_ticks_of_a_log_axis_drawn_as_one_line_look_the_same(low, high):
    """MinorMarks: a log axis' unlabelled minor ticks are one line of marks, not a Tick each, with
    the pixels of matplotlib's ticks; where minor ticks are labelled (under a decade) the axis
    draws them itself."""
    from matplotlib.figure import Figure

    import sim.output.report as report

    def drawn(marks):
        fig = Figure(figsize=(8, 5))
        axes = fig.subplots(1, 2)
        for ax, log in zip(axes, ("x", "y")):
            data = np.geomspace(low, high, 20)
            ax.plot(data, data[::-1] if log == "y" else np.arange(20))
            ax.set_xscale("log") if log == "x" else ax.set_yscale("log")
            if marks:
                report.finish_axes(ax, "t", "y", "x")
            else:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(report.MinorMarks, "add_to", classmethod(lambda cls, axis: None))
                    report.finish_axes(ax, "t", "y", "x")
        return axes, report.figure_pixels(fig, 60)

    axes, pixels = drawn(True)
    plain_axes, plain = drawn(False)
    assert np.array_equal(pixels, plain)
    for ax, plain_ax, axis in ((axes[0], plain_axes[0], "xaxis"), (axes[1], plain_axes[1], "yaxis")):
        made, plain_made = len(getattr(ax, axis).minorTicks), len(getattr(plain_ax, axis).minorTicks)
        labelled = any(t.label1.get_text() for t in getattr(plain_ax, axis).minorTicks)
        assert plain_made > 5 and (made == plain_made if labelled else made == 1)
        assert labelled == (high / low < 10)


def test_big_numbers_on_either_axis_are_shortened():
    """A CDF's x axis in ms reaches 600000 on an overloaded run: side by side, six-digit labels ran
    together ("100000200000..."); both linear axes label 10,000 and up in thousands."""
    from matplotlib.figure import Figure

    from sim.output.report import figure_pixels, finish_axes

    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.plot([0, 6e5], [0, 3e4])
    finish_axes(ax, "t", "y", "x")
    figure_pixels(fig, 40)
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        texts = [t.get_text() for t in labels if t.get_text()]
        assert "600k" in texts or "30k" in texts
        assert all(len(text) <= 4 for text in texts), texts


def test_the_queue_legend_sits_under_its_panel_inside_the_figure(views):
    """The queue panel's series and preemption marks fill it, so its legend goes under the x label
    (a run's entries a row, or a run a column), where it hides nothing, and the figure grows to
    hold it."""
    from sim.output.report import DPI, figure_pixels, plot_queue, titled

    for shown in (views, {"continuous": views["continuous"]}):
        fig = titled(plot_queue(shown), "a title")
        fig.dpi = DPI
        figure_pixels(fig, DPI)
        renderer = fig.canvas.get_renderer()
        ax, = fig.axes
        legend = ax.get_legend().get_window_extent(renderer)
        labels = ax.xaxis.label.get_window_extent(renderer)
        assert 0 <= legend.y0 and legend.y1 <= labels.y0, shown.keys()           # under the x label
        assert 0 <= legend.x0 and legend.x1 <= fig.bbox.width
        assert len(ax.get_legend().get_texts()) == len(ax.get_legend_handles_labels()[0])
        assert fig.get_figheight() > 4                                        # (new_figure's 4 in)
