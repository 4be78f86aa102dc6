"""Untrusted input (issue 15): names, YAML, bounds, output folders, error text, zero-finished runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.cli import main
from sim.names import folder_name, name_problem
from sim.scenario import ScenarioError, validate_scenario

BASE = {"model": "qwen2.5-0.5b", "device": "h100-sxm"}
SMALL = "model: qwen2.5-0.5b\ndevice: h100-sxm\nworkload: {num_requests: 4, prompt_len: 16, output_len: 4}\n"


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


# ----------------------------------------------------------------------------- 1. names

HOSTILE_NAMES = ["../../../x", "/abs/x", "", "/", "..", ".", "a/b", "a\\b", ".hidden", "report.html",
                 "x" * 101, "a\x00b", "-rf", "a\nb"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_hostile_variant_names_are_refused(name):
    assert name_problem(name)
    with pytest.raises(ScenarioError, match="variants: variant name"):
        validate_scenario({**BASE, "variants": {name: {}, "ok": {}}})


def test_hostile_variant_names_write_nothing_anywhere(tmp_path, capsys, monkeypatch):
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    names = {n: {} for n in HOSTILE_NAMES if "\x00" not in n}
    scenario = work / "s.yaml"
    scenario.write_text(SMALL + "variants: " + json.dumps(names) + "\n")
    before = files_under(tmp_path)
    assert main([str(scenario), "--out", str(work / "out")]) == 2
    assert files_under(tmp_path) == before
    assert "variant name" in capsys.readouterr().err


def test_plain_names_pass_and_folder_name_makes_any_text_safe():
    for name in ("static", "bs16", "lengths_35_17_64", "v1.5", "rate=2,tp=1"):
        assert name_problem(name) is None, name
    for text in HOSTILE_NAMES + ["meta-llama/Llama-3.1-8B"]:
        assert name_problem(folder_name(text)) is None, text
