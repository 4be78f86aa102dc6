"""docs/scenario_reference.md is generated from the schema: it must match a fresh rendering, and
every field must carry the description the page is made of."""
import importlib.util
from pathlib import Path

from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python scripts/make_scenario_reference.py"


def generator():
    spec = importlib.util.spec_from_file_location("make_scenario_reference",
                                                  ROOT / "scripts" / "make_scenario_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_schema_field_has_a_description():
    missing = generator().undescribed()
    assert not missing, ("schema fields without Field(description=...): " + ", ".join(missing)
                         + f"; describe them in sim/scenario.py / sim/core/catalog.py, then run {REGENERATE}")


def test_the_committed_reference_is_fresh():
    gen = generator()
    committed = gen.PAGE.read_text(encoding="utf-8")
    assert committed == gen.render(), f"docs/scenario_reference.md is stale: run {REGENERATE} and commit it"


def test_the_reference_names_every_field_with_its_default_and_bounds():
    from sim.scenario import EngineConfig

    page = generator().render()
    for name, info in EngineConfig.model_fields.items():
        assert f"| `{name}` |" in page and info.description in page.replace("\\|", "|")
    assert "| `block_size` | integer | `16` | ≥ 1, ≤ 1,024 |" in page
    assert "| `batching` | `continuous` \\| `static` | `continuous` |" in page
    assert "Used by `workload.prompt_len`, `workload.output_len`" in page     # one section, many paths


def test_a_field_without_a_description_is_reported():
    class Inner(BaseModel):
        told: int = Field(default=1, description="a described field")
        untold: int = 2

    class Root(BaseModel):
        inner: Inner = Field(default_factory=Inner, description="nested")

    assert generator().undescribed(Root) == ["inner.untold (Inner)"]
