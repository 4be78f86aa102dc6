"""kvtwin installs three generic top-level packages, `sim`, `engine` and `validate` (the layout it
was specified with). Another package of one of these names on the path would be imported in place
of kvtwin's, or be hidden by it, silently. `check_top_level_modules` runs when `sim` is first
imported (every kvtwin module imports it) and refuses to go on if `engine` or `validate` would come
from somewhere other than the folder `sim` came from; a same-named package further down the path,
which kvtwin's hides, is named in a warning.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import warnings
from pathlib import Path

OWN_PACKAGES = ("sim", "engine", "validate")


class ShadowedModuleError(ImportError):
    """Another package answers to one of kvtwin's top-level names."""


def locations(name: str, path: list[str]) -> list[Path]:
    """Where a top-level module `name` could be imported from, in sys.path order (no import)."""
    found = []
    for entry in path:
        spec = importlib.machinery.PathFinder.find_spec(name, [entry or "."])
        if spec is not None and spec.origin not in (None, "namespace"):
            found.append(Path(spec.origin).resolve())
    return found


def imported_from(name: str) -> Path | None:
    """The file `import name` would run (every finder, editable installs included), without importing."""
    module = sys.modules.get(name)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
    return Path(spec.origin).resolve() if spec is not None and spec.origin not in (None, "namespace") else None


def check_top_level_modules(path: list[str] | None = None, root: Path | None = None) -> None:
    """Raise ShadowedModuleError when kvtwin's `engine` or `validate` is not the one Python imports;
    warn when kvtwin's packages hide other packages of the same names."""
    path = list(sys.path if path is None else path)
    root = (root or Path(__file__).resolve().parents[1])
    hidden = []
    for name in OWN_PACKAGES:
        ours = root / name / "__init__.py"
        found = locations(name, path)
        winner = ours if name == "sim" else imported_from(name)
        if winner != ours:
            where = winner or "nothing"
            raise ShadowedModuleError(
                f"kvtwin's package `{name}` ({ours.parent}) is shadowed: `import {name}` would load {where}. "
                f"Rename or uninstall the other `{name}`, or run from an environment where kvtwin comes first "
                f"on sys.path (see README, 'Installing').")
        hidden += [str(p) for p in found if p != ours]
    if hidden:
        warnings.warn("kvtwin's top-level packages (sim, engine, validate) hide other modules of the same "
                      f"names: {', '.join(hidden)}", RuntimeWarning, stacklevel=3)
