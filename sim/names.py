"""User-given names that become file or folder names (variants, profiles): safe or refused.

A scenario is untrusted input, so a name it gives must not reach outside the output folder
(`../x`, `/etc`), hide itself (`.x`), collide with a file kvtwin writes beside it
(`report.html`), or be a name the file system rejects (empty, too long, control characters).
"""
from __future__ import annotations

import re

MAX_NAME = 100
_ALLOWED = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=,@-]*")
# Suffixes of the files kvtwin writes into a run folder: a variant folder must not take one.
_OUTPUT_SUFFIXES = (".json", ".csv", ".html", ".png", ".yaml", ".tmp")
# ... nor the name of one without a suffix: the marker of a run not finished (sim/output/run_dir.py),
# in any case (a case-insensitive file system has one name for both)
_OUTPUT_NAMES = ("incomplete",)


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a folder name, or None when it can."""
    if not isinstance(name, str):
        return f"expected a name (text), got {type(name).__name__}"
    if not name:
        return "an empty name cannot be a folder"
    if len(name) > MAX_NAME:
        return f"{len(name)} characters long, at most {MAX_NAME} allowed"
    if not _ALLOWED.fullmatch(name):
        return (f"not a safe folder name (allowed: letters, digits and _ . + = , @ -, not starting "
                f"with a symbol other than _; e.g. {folder_name(name)!r})")
    if name.lower().endswith(_OUTPUT_SUFFIXES):
        return f"ends like a file kvtwin writes ({' '.join(_OUTPUT_SUFFIXES)}); pick another name"
    if name.lower() in _OUTPUT_NAMES:
        return "the name of a file kvtwin writes into a run folder; pick another name"
    return None


def folder_name(text: str) -> str:
    """A safe stand-in for `text`: unsafe characters become '_', bounded length, never empty."""
    safe = re.sub(r"[^A-Za-z0-9._+=,@-]", "_", str(text))[:MAX_NAME - 1]
    safe = re.sub(r"^[^A-Za-z0-9_]", "_", safe) or "_"
    return safe + "_" if safe.lower().endswith(_OUTPUT_SUFFIXES) or safe.lower() in _OUTPUT_NAMES else safe
