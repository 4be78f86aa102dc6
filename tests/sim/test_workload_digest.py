"""The manifest's workload text made from columns (sim/predict.py described_text) is repr's, byte
for byte, with and without pyarrow; requests of another form go tuple by tuple."""
import random

import pytest

import sim.columns as columnar
from sim.predict import _columnar_text, described_text, figure_columns


def _plain(rng: random.Random, n: int, k: int, tenants=(None,)) -> list[tuple]:
    arrivals = [rng.choice([0.0, -0.0, 1.0, 2.5e-7, 1e-4, 3e9, 1e22, 5e-324]) if rng.random() < 0.2
                else rng.random() * 10 ** rng.randint(-6, 10) for _ in range(n)]
    return [(i * rng.choice([1, -1, 977]), arrivals[i], rng.randint(0, 10 ** 6), rng.randint(1, 4096),
             rng.choice(tenants), rng.randint(-3, 3),
             [(rng.getrandbits(63), rng.randint(1, 8192)) for _ in range(k)]) for i in range(n)]


def _by_columns(described: list[tuple]):
    return _columnar_text(*figure_columns(described))


def _expected(described: list[tuple]) -> bytes:
    return "".join(map(repr, described)).encode()


@pytest.mark.parametrize("with_arrow", [True, False])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_columnar_text_is_repr(monkeypatch, with_arrow, k):
    if with_arrow:
        pytest.importorskip("pyarrow")
    else:
        monkeypatch.setattr(columnar, "_pyarrow", lambda: None)
    rng = random.Random(k)
    for tenants in ((None,), ("a", "bé", "", "x,y'\"", None)):
        described = _plain(rng, 500, k, tenants)
        text = _by_columns(described)
        assert text is not None
        assert text == _expected(described)


@pytest.mark.parametrize("with_arrow", [True, False])
def test_columnar_text_of_requests_with_different_numbers_of_segments(monkeypatch, with_arrow):
    """A shared prefix only some conversations carry (bench_sim_speed: 80 %), a dynamic segment, a
    multi-turn prompt: each segment slot's rows without it are left out, the text still repr's."""
    if with_arrow:
        pytest.importorskip("pyarrow")
    else:
        monkeypatch.setattr(columnar, "_pyarrow", lambda: None)
    rng = random.Random(11)
    described = [row for k in (0, 1, 2, 3) for row in _plain(rng, 200, k, ("a", None))]
    rng.shuffle(described)
    text = _by_columns(described)
    assert text is not None
    assert text == _expected(described)


@pytest.mark.parametrize("odd", [
    (1, None, 5, 5, None, 0, [(1, 2)]),                 # a follow-up turn: no arrival
    (1, 1.5, 5, 5, None, True, [(1, 2)]),               # a bool
    (1, float("nan"), 5, 5, None, 0, [(1, 2)]),
    (1, 1.5, 5, 5, None, 0, [("lit", 3, -7)]),          # a literal segment's description
    (1, 1.5, 5, 5, None, 0, [(1, 2), (3, 4)]),          # another number of segments
    (2 ** 70, 1.5, 5, 5, None, 0, [(1, 2)]),
    (1, 1.5, 5, 5, ["unhashable"], 0, [(1, 2)]),
])
def test_other_forms_go_by_repr(odd):
    described = _plain(random.Random(7), 50, 1) + [odd]
    assert described_text(described) == _expected(described)


def test_empty_batch():
    assert described_text([]) == b""


@pytest.mark.parametrize("scenario", ["vidur_llama2_70b", "bench_prefix_reuse", "quickstart",
                                      "bench_sim_speed"])
def test_digest_does_not_depend_on_the_columns(monkeypatch, scenario):
    """The manifest's digest is the same whether each batch's text is made from columns or by repr."""
    from sim.predict import WorkloadDescription
    from sim.scenario import load_scenario
    from sim.workload import build_requests

    requests = build_requests(load_scenario(f"scenarios/{scenario}.yaml", ["workload.num_requests=600"]))
    digests = []
    for after in (0, 10 ** 9):
        monkeypatch.setattr(WorkloadDescription, "COLUMNAR_AFTER", after)
        monkeypatch.setattr(WorkloadDescription, "BATCH", 128)
        described = WorkloadDescription()
        for r in requests:
            described.add(r)
        digests.append(described.manifest([]))
    assert digests[0] == digests[1]


@pytest.mark.parametrize("with_arrow", [True, False])
def test_columns_of_one_value_are_one_text(monkeypatch, with_arrow):
    """A column whose every row holds one value (a fixed length, one priority, one tenant, a shared
    prefix's key among the rows that carry it) goes in as that value's text, once: still repr's."""
    if with_arrow:
        pytest.importorskip("pyarrow")
    else:
        monkeypatch.setattr(columnar, "_pyarrow", lambda: None)
    rng = random.Random(3)
    described = []
    for i, row in enumerate(_plain(rng, 300, 2, ("tenant é",))):
        segs = [row[6][1], (77, 512)] if i % 3 else [row[6][1]]     # a second segment on two rows in three
        described.append((row[0], row[1], 512, 128, row[4], -2, segs))
    assert _by_columns(described) == _expected(described)
    assert _by_columns(described[:1]) == _expected(described[:1])


_DRAWN_SCENARIO = """
name: drawn
model: qwen2.5-0.5b
device: h100-sxm
engine: {prefix_caching: true, max_model_len: 4096}
workload:
  num_requests: 700
  arrival: {process: ARRIVAL, rate: 50}
  prompt_len: {dist: sharegpt}
  output_len: {dist: uniform, min: 1, max: 300}
  shared_prefix: {groups: 3, length: 128, fraction: FRACTION}
  tenants:
    - {name: alpha, share: 0.7, salt: true}
    - {name: "b'é", share: 0.3}
  priorities: {values: [0, -2, 9]}
"""


@pytest.mark.parametrize("with_arrow", [True, False])
@pytest.mark.parametrize("arrival, fraction", [("poisson", 0.6), ("vidur_poisson", 0.0), ("offline", 1.0)])
@pytest.mark.parametrize("columnar_after", [0, 10 ** 9])
def test_drawn_requests_describe_as_the_made_requests(tmp_path, monkeypatch, with_arrow, arrival, fraction,
                                                       columnar_after):
    """A single-turn synthetic stream describes each chunk from the arrays its requests are made
    from (sim.workload.DrawnRequests, WorkloadDescription.add_drawn): the manifest's workload entry
    is the one `watch` gives on the made requests, chunks of the draws crossing its batches, by
    columns and by repr, with and without pyarrow; tenants, priorities and a shared prefix some
    requests carry (a chunk drawn whole, `_WholeDraws`, with vidur_poisson arrivals)."""
    import sim.workload as wl
    from sim.predict import WorkloadDescription
    from sim.scenario import load_scenario

    if with_arrow:
        pytest.importorskip("pyarrow")
    else:
        monkeypatch.setattr(columnar, "_pyarrow", lambda: None)
    monkeypatch.setattr(wl, "LISTED_CHUNK", 256)
    monkeypatch.setattr(WorkloadDescription, "BATCH", 100)
    monkeypatch.setattr(WorkloadDescription, "COLUMNAR_AFTER", columnar_after)
    path = tmp_path / "drawn.yaml"
    path.write_text(_DRAWN_SCENARIO.replace("ARRIVAL", arrival).replace("FRACTION", str(fraction)))
    scenario = load_scenario(path)
    watched, drawn = WorkloadDescription(), WorkloadDescription()
    requests = list(watched.watch(wl.stream_requests(scenario).requests))
    stream = wl.stream_requests(scenario, describe=drawn.add_drawn)
    assert stream.described
    made = list(stream.requests)
    assert [(r.id, r.arrival, r.segments) for r in made] == [(r.id, r.arrival, r.segments) for r in requests]
    assert drawn.manifest([]) == watched.manifest([])
    assert drawn.lengths.count == len(made) == 700


def test_streams_not_drawn_as_arrays_are_watched():
    """A multi-turn or dynamic-segment workload is not described from the draws: `described` is
    False and the caller watches the made requests."""
    from sim.scenario import load_scenario
    from sim.workload import describable, stream_requests

    for name in ("seed_prefix_timestamp", "whatif_kv_offload"):
        scenario = load_scenario(f"scenarios/{name}.yaml", ["workload.num_requests=50"])
        assert not describable(scenario.workload)
        assert not stream_requests(scenario, describe=lambda drawn: None).described
