"""Hostile names: variant and scenario names kvtwin would turn into folders, and error text
printed literally (no markup, no emoji)."""
from __future__ import annotations

import json

import pytest

from sim.cli import main
from sim.names import folder_name, name_problem
from sim.scenario import ScenarioError, validate_scenario

from support import BASE, files_under, run_cli, SMALL


HOSTILE_NAMES = ["../../../x", "/abs/x", "", "/", "..", ".", "a/b", "a\\b", ".hidden", "report.html",
                 "x" * 101, "a\x00b", "-rf", "a\nb",
                 # the marker of a run not finished: a variant folder of that name met the file
                 # ('[Errno 17] File exists: out/INCOMPLETE'; found by h/audit2)
                 "INCOMPLETE", "incomplete"]


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


def test_a_scenario_name_with_control_characters_is_refused(tmp_path, capsys):
    for name in ("a\x07b", "\x1b[31mred", "two\nlines"):
        with pytest.raises(ScenarioError, match="name: .* holds the control character"):
            validate_scenario({**BASE, "name": name})
    validate_scenario({**BASE, "name": "plain name é", "description": "two\nlines\tand a tab"})
    with pytest.raises(ScenarioError, match="description: .* control character"):
        validate_scenario({**BASE, "description": "\x1b[2J"})


def test_errors_print_literally_without_markup_or_emoji(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(SMALL + 'variants: {":x: [bold]b[/bold]": {}}\n')
    code, err = run_cli([path, "--out", tmp_path / "o"], capsys)
    assert code == 2 and ":x: [bold]b[/bold]" in err and "\u274c" not in err
