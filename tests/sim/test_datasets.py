"""workload.dataset: ShareGPT-format JSON, text prompts and sonnet lines through a local tokenizer
(tests/data/datasets, made by scripts/make_test_dataset.py), and vLLM's random set."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sim.predict import predict
from sim.scenario import ScenarioError, validate_scenario
from sim.workload import WorkloadError, build_workload

DATA = Path(__file__).resolve().parents[1] / "data" / "datasets"
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A copy of the data sets, with a token cache folder of its own (cache_of)."""
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("sharegpt_small.json", "prompts.txt", "sonnet_small.txt", "tokenizer.json"):
        shutil.copy(DATA / name, folder / name)
    monkeypatch.setenv("KVTWIN_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def cache_of(data: Path) -> list[Path]:
    return sorted((data.parent / "cache" / "tokens").glob("*.npz"))


def _scenario(data: Path, dataset: dict, **workload):
    return validate_scenario({"model": "tiny", "device": "cpu", "seed": 5,
                              "engine": {"num_blocks": 512, "max_model_len": 2048},
                              "workload": {"num_requests": 20, "dataset": dataset, **workload}}, base_dir=data)


def _encode(data: Path, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(data / "tokenizer.json")).encode(text).ids


def test_sharegpt_first_turns_are_vllms_prompt_and_answer_length(data):
    s = _scenario(data, {"format": "sharegpt", "path": "sharegpt_small.json", "tokenizer": "tokenizer.json"})
    built = build_workload(s)
    convs = json.loads((data / "sharegpt_small.json").read_text())
    pairs = {(tuple(_encode(data, c["conversations"][0]["value"])), len(_encode(data, c["conversations"][1]["value"])))
             for c in convs if len(c["conversations"]) >= 2}
    assert len(built.requests) == 20
    for r in built.requests:
        assert (tuple(r.segments[0]), r.output_len) in pairs and r.next_turn is None
    assert any("tokenized" in n for n in built.notes)
    assert len(cache_of(data)) == 1
    again = build_workload(s)                              # the second build reads the cache
    assert any("from the cache" in n for n in again.notes)
    assert [r.segments for r in again.requests] == [r.segments for r in built.requests]


def test_sharegpt_all_turns_chain_conversations(data):
    s = _scenario(data, {"format": "sharegpt", "path": "sharegpt_small.json", "tokenizer": "tokenizer.json",
                         "turns": "all", "think_time_s": 1.0}, num_requests=30)
    requests = build_workload(s).requests
    follow = [r for r in requests if r.arrival is None]
    assert follow, "the small set has multi-turn conversations"
    for r in requests:
        if r.next_turn is not None:
            nxt = r.next_turn
            assert nxt.segments[: len(r.segments)] == r.segments and r.think_time == 1.0
            assert nxt.conversation == r.conversation
    run = predict(s)
    assert run.summary["prefix_hit_rate"] > 0.3            # later turns reuse the earlier turns' blocks


def test_text_prompts_take_output_lengths_from_the_workload(data):
    s = _scenario(data, {"format": "text", "path": "prompts.txt", "tokenizer": "tokenizer.json"},
                  output_len={"dist": "uniform", "min": 5, "max": 9})
    requests = build_workload(s).requests
    lines = [line for line in (data / "prompts.txt").read_text().splitlines() if line]
    encoded = {tuple(_encode(data, line)) for line in lines}
    assert all(tuple(r.segments[0]) in encoded and 5 <= r.output_len <= 9 for r in requests)


def test_random_set_is_vllms(data):
    s = _scenario(data, {"format": "random", "input_len": 100, "output_len": 20, "range_ratio": 0.5,
                         "prefix_len": 32}, num_requests=400)
    requests = build_workload(s).requests
    prompt = np.array([r.prompt_len for r in requests]) - 32
    output = np.array([r.output_len for r in requests])
    assert prompt.min() >= 50 and prompt.max() <= 150 and abs(prompt.mean() - 100) < 5
    assert output.min() >= 10 and output.max() <= 30
    assert len({r.segments[0] for r in requests}) == 1     # one prefix shared by all


def test_sonnet_shares_its_head_and_sizes_prompts(data):
    s = _scenario(data, {"format": "sonnet", "path": "sonnet_small.txt", "tokenizer": "tokenizer.json",
                         "input_len": 200, "prefix_len": 80}, arrival={"process": "fixed", "rate": 50})
    requests = build_workload(s).requests
    lengths = np.array([r.prompt_len for r in requests])
    assert abs(lengths.mean() - 200) < 40 and all(r.output_len == 150 for r in requests)
    heads = {tuple(r.segments[0][:60]) for r in requests}
    assert len(heads) == 1
    assert predict(s).summary["prefix_hit_rate"] > 0.2


@pytest.mark.parametrize("fmt, extra", [("sonnet", {"path": "sonnet_small.txt", "tokenizer": "tokenizer.json"}),
                                         ("random", {})])
def test_a_dataset_at_its_format_defaults_rebuilds_the_same_requests_from_its_resolved_dump(data, fmt, extra):
    """The manifest records the resolved scenario (every field): read back, it must give the same
    workload. sonnet's defaults (550 input, 200 shared tokens) differ from the schema's (random's
    1024 and 0): the dump listed 1024 and 0 where 550 and 200 had been used (found by h/audit)."""
    s = _scenario(data, {"format": fmt, **extra}, arrival={"process": "fixed", "rate": 50})
    again = validate_scenario(s.model_dump(mode="json"), base_dir=data)
    first, second = build_workload(s).requests, build_workload(again).requests
    assert [(r.prompt_len, r.output_len) for r in first] == [(r.prompt_len, r.output_len) for r in second]
    if fmt == "sonnet":
        assert abs(np.mean([r.prompt_len for r in first]) - 550) < 60


def test_dataset_errors_name_the_problem(data, tmp_path):
    with pytest.raises(ScenarioError, match="needs path and tokenizer"):
        _scenario(data, {"format": "sharegpt", "path": "sharegpt_small.json"})
    with pytest.raises(ScenarioError, match="prompt_len describe synthetic prompts"):
        _scenario(data, {"format": "random"}, prompt_len=10)
    (data / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(WorkloadError, match="bad.json: expected a JSON list"):
        build_workload(_scenario(data, {"format": "sharegpt", "path": "bad.json", "tokenizer": "tokenizer.json"}))
    small_vocab = validate_scenario({"model": {"base": "tiny", "vocab_size": 100}, "device": "cpu", "workload": {
        "num_requests": 2, "dataset": {"format": "text", "path": str(data / "prompts.txt"),
                                       "tokenizer": str(data / "tokenizer.json")}}})
    with pytest.raises(WorkloadError, match="more than the model's vocab_size"):
        build_workload(small_vocab)


SHAREGPT_TURNS = {"format": "sharegpt", "path": "sharegpt_small.json", "tokenizer": "tokenizer.json", "turns": "all"}


@pytest.mark.parametrize("dataset, field, value", [
    ({"format": "random"}, "input_len", 2**27 + 1), ({"format": "random"}, "output_len", 10**17),
    ({"format": "random"}, "prefix_len", 10**20), (SHAREGPT_TURNS, "think_time_s", 1e300)])
def test_dataset_lengths_and_think_time_are_bounded_as_every_other(data, dataset, field, value):
    # unbounded, a think time of 1e300 s printed "1e-299 req/s" and a numpy overflow warning
    with pytest.raises(ScenarioError, match=rf"workload.dataset.{field}: Input should be less than or equal to"):
        _scenario(data, {**dataset, field: value})


@pytest.mark.parametrize("dataset, message", [
    ({"format": "sharegpt", "path": "sharegpt_small.json", "tokenizer": "tokenizer.json", "input_len": 3000},
     "input_len is read only with format random or sonnet, not sharegpt; remove it"),
    ({"format": "random", "turns": "all"}, "turns is read only with format sharegpt, not random"),
    ({"format": "sonnet", "path": "sonnet_small.txt", "tokenizer": "tokenizer.json", "range_ratio": 0.5},
     "range_ratio is read only with format random, not sonnet"),
    ({"format": "text", "path": "prompts.txt", "tokenizer": "tokenizer.json", "filter": False},
     "filter is read only with format sharegpt, not text"),
    ({"format": "sharegpt", "path": "sharegpt_small.json", "tokenizer": "tokenizer.json", "think_time_s": 5},
     "think_time_s is the pause before a conversation's follow-up: it needs turns: all"),
])
def test_a_dataset_field_its_format_never_reads_is_an_error(data, dataset, message):
    # it ran as if unset: input_len 3000 on a sharegpt set gave the same prediction as none
    with pytest.raises(ScenarioError, match=rf"workload.dataset: {message}"):
        _scenario(data, dataset)
    at_default = {k: v for k, v in dataset.items() if k in ("format", "path", "tokenizer")}
    _scenario(data, {**at_default, "input_len": 1024, "turns": "first", "filter": True, "range_ratio": 0.0})


def test_a_transformers_folder_brings_its_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    from sim.datasets import text_tokenizer

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_file(str(DATA / "tokenizer.json")))
    fast.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    fast.save_pretrained(tmp_path)
    tok = text_tokenizer(tmp_path)
    assert tok.apply_chat_template is not None
    assert tok.apply_chat_template([{"role": "user", "content": "Why batch?"}]) == \
        tok.encode("<user>Why batch?<assistant>")
    assert text_tokenizer(DATA / "tokenizer.json").apply_chat_template is None


# ----------------------------------------------------------------------------- bounded reads

def test_a_tokenizer_folder_file_over_the_limit_or_not_a_file_is_refused_by_name(tmp_path, monkeypatch):
    import sim.datasets as datasets

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)       # weights: never opened for a tokenizer
    (folder / "vocab.json").write_text("x" * 2048)
    monkeypatch.setattr(datasets, "MAX_TOKENIZER_BYTES", 1024)
    with pytest.raises(datasets.DatasetError, match=r"vocab\.json: .* larger than the 0 MiB allowed"):
        datasets.text_tokenizer(folder)
    (folder / "vocab.json").unlink()
    (folder / "tokenizer.model").symlink_to("/dev/zero")             # would be read forever
    with pytest.raises(datasets.DatasetError, match=r"tokenizer\.model: not a regular file"):
        datasets.tokenizer_files(folder)


def test_the_bounded_reader_refuses_a_device_that_reports_no_size(tmp_path):
    from sim.core.files import FileFormatError, read_text

    (tmp_path / "s.yaml").symlink_to("/dev/zero")                 # st_size 0, and never ends
    with pytest.raises(FileFormatError, match=r"s\.yaml: not a regular file"):
        read_text(tmp_path / "s.yaml", "scenario")


def _npy(shape: tuple, dtype: str) -> bytes:
    """An .npy member whose header declares `shape` but that holds no data."""
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                  "shape": shape})
    return buffer.getvalue()


def test_a_token_cache_larger_than_its_data_set_can_need_is_refused_by_name(data):
    import zipfile

    s = _scenario(data, {"format": "text", "path": "prompts.txt", "tokenizer": "tokenizer.json"})
    build_workload(s)
    (cache,) = cache_of(data)
    with zipfile.ZipFile(cache) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    # np.load would allocate this header's 8 TiB up front
    members["ids.npy"] = _npy((1 << 41,), "<i4")
    with zipfile.ZipFile(cache, "w") as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    with pytest.raises(WorkloadError, match=r"tokens/\w+\.npz: its ids\.npy declares a \(2199023255552,\)"):
        build_workload(s)
    cache.write_bytes(b"PK" + b"\0" * (64 << 20))                      # bigger than any cache of this set
    with pytest.raises(WorkloadError, match=r"tokens/\w+\.npz: 64\.0 MiB, more than"):
        build_workload(s)
    cache.write_bytes(b"damaged")                                    # small and unreadable: rebuilt
    assert not any("from the cache" in n for n in build_workload(s).notes)
    assert any("from the cache" in n for n in build_workload(s).notes)


# ----------------------------------------------------------------------------- where the cache lies

def test_the_token_cache_is_written_to_kvtwins_cache_folder_never_beside_the_data_set(data):
    """A scenario names the data set's path: that decides what is read, never where a file is
    written (docs/security.md). The data set's folder is left as it was."""
    before = sorted(p.name for p in data.iterdir())
    s = _scenario(data, {"format": "text", "path": "prompts.txt", "tokenizer": "tokenizer.json"})
    notes = build_workload(s).notes
    assert sorted(p.name for p in data.iterdir()) == before
    (cache,) = cache_of(data)
    assert any(str(cache) in n for n in notes)


def test_the_cache_folder_follows_kvtwin_cache_dir_then_xdg_cache_home_then_the_home_folder(tmp_path, monkeypatch):
    from sim.datasets import token_cache_dir

    monkeypatch.setenv("KVTWIN_CACHE_DIR", str(tmp_path / "mine"))
    assert token_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("KVTWIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache_dir() == tmp_path / "xdg" / "kvtwin"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")            # the XDG spec: ignored unless absolute
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert token_cache_dir() == tmp_path / "home" / ".cache" / "kvtwin"
