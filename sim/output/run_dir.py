"""Output folders kvtwin owns: checked before simulating, cleaned of its own stale files, marked
INCOMPLETE until the run finishes.

A run folder holds `.kvtwin-run` (JSON: which files kvtwin wrote there, and which foreign files
were there when `--force` let it write anyway). A new run into the folder
  - refuses a folder holding files kvtwin did not write, unless `force`;
  - removes the files of the earlier run (a stale trace.json of another scenario must not sit
    beside the new summary.json) and any temporary file an interrupted write left behind;
  - writes `INCOMPLETE` first and removes it last, so a folder whose run was killed says so.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sim import stop
from sim.errors import UserError
from sim.output.io import confined_to, write_json, write_text

MARKER = ".kvtwin-run"
INCOMPLETE = "INCOMPLETE"
_OWN = {MARKER, INCOMPLETE}


class OutputFolderError(UserError):
    """An output folder kvtwin may not (or cannot) write into."""


def out_folder_arg(text: str) -> Path:
    """argparse `type=` for --out: an empty or blank path is refused (it would mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a folder, e.g. --out runs/mine")
    return Path(text)


def out_file_arg(text: str) -> Path:
    """argparse `type=` for an --out that names one file: an empty or blank path is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file, e.g. --out my_scenario.yaml")
    return Path(text)


def check_out_file(path: Path, written_by: str, force: bool = False) -> None:
    """Raise OutputFolderError unless kvtwin may write the single file `path` (atomically, with
    sim.output.io). A file is its own ownership marker: it starts with `written_by`, the header
    kvtwin writes (so its own earlier output is replaced); any other file there, or a link, is
    refused unless `force`. Nothing is written."""
    path = Path(path)
    if path.is_dir():
        raise OutputFolderError(f"{path}: is a folder; --out names the file to write (e.g. {path}/scenario.yaml)")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise OutputFolderError(f"{path}: cannot be written ({parent} is not a writable folder) (--out)")
    if not (path.exists() or path.is_symlink()) or force:
        return
    own = False
    if path.is_file() and not path.is_symlink():
        with path.open("rb") as f:
            own = f.read(len(written_by.encode())) == written_by.encode()
    if not own:
        raise OutputFolderError(f"{path}: exists and kvtwin did not write it; pick another --out, or pass "
                                f"--force to replace it")


def _is_temp(rel: str) -> bool:
    """A temporary file of sim.output.io.atomic_path (`.NAME.XXXX.tmp`)."""
    name = rel.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(".tmp")


def _files(folder: Path) -> set[str]:
    """Every file under `folder`, as POSIX paths relative to it (links count as files, unfollowed).
    A subfolder with its own marker (a sweep's or plan's folder inside a run's) is another run's
    folder: neither listed nor touched."""
    found = set()
    for root, dirs, names in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        found.update((rel_root / n).as_posix() for n in names)
        found.update((rel_root / d).as_posix() for d in dirs if (Path(root) / d).is_symlink())
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink() and not (Path(root) / d / MARKER).is_file()]
    return found


def _read_marker(folder: Path) -> dict | None:
    path = folder / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("kvtwin") == "run folder" else None


def _owned_and_foreign(folder: Path, present: set[str]) -> tuple[set[str], set[str]]:
    """Files of kvtwin's earlier run here, and files that are someone else's."""
    marker = _read_marker(folder)
    if marker is None:                                  # not kvtwin's: every file is foreign
        return set(), present
    foreign = set(map(str, marker.get("foreign") or []))     # there before a --force run
    if isinstance(marker.get("files"), list):           # a finished run listed what it wrote
        owned = set(map(str, marker["files"]))
    else:                                               # an interrupted run: all but the foreign files
        owned = present - foreign
    owned |= {f for f in present if _is_temp(f) and f not in foreign} | _OWN
    # `& present`: the marker is a file like any other; only what is really under `folder` counts
    return owned & present, present - owned


def check_out_folder(folder: Path, force: bool = False) -> set[str]:
    """Raise OutputFolderError unless kvtwin may write into `folder`; the foreign files it would
    leave alone (non-empty only with `force`). Nothing is written."""
    folder = Path(folder)
    if str(folder).strip() == "":
        raise OutputFolderError("--out is empty; give a folder")
    if folder.exists() and not folder.is_dir():
        raise OutputFolderError(f"{folder}: exists and is not a folder (--out)")
    if not folder.exists():
        parent = next((p for p in folder.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise OutputFolderError(f"{folder}: cannot be created ({parent} is not a writable folder) (--out)")
        return set()
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputFolderError(f"{folder}: not writable (--out)")
    _, foreign = _owned_and_foreign(folder, _files(folder))
    if foreign and not force:
        shown = ", ".join(sorted(foreign)[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        unmarked = (folder / "manifest.json").is_file() and _read_marker(folder) is None
        older = " (a run of a kvtwin without output markers?)" if unmarked else ""
        raise OutputFolderError(f"{folder}: holds files kvtwin did not write ({shown}){older}; pick another "
                                f"--out, empty it, or pass --force to write beside them")
    return foreign


def _remove_stale(folder: Path, owned: set[str]) -> None:
    for rel in sorted(owned):
        (folder / rel).unlink(missing_ok=True)
    for root, dirs, _ in os.walk(folder, topdown=False):   # folders the old files leave empty
        for d in dirs:
            path = Path(root) / d
            if not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()


def _remove_temp_files(folder: Path, foreign: set[str]) -> None:
    try:
        for rel in _files(folder) - foreign:
            if _is_temp(rel):
                (folder / rel).unlink(missing_ok=True)
    except OSError:
        pass                    # best effort on the way out: the error being raised is the one to report


@contextmanager
def owned_run_folder(folder: Path, force: bool = False) -> Iterator[Path]:
    """Check, clean and mark `folder` for a run; on success list what was written and drop INCOMPLETE.
    On failure INCOMPLETE stays, and the next run into the folder removes the partial files."""
    folder = Path(folder)
    foreign = check_out_folder(folder, force)
    # SIGTERM and Ctrl-C ask for a stop (sim/stop.py); the work stops at its next check with
    # StopRequested, so INCOMPLETE stays and temp files are removed on the way out
    with stop.stop_on_signals():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            owned, _ = _owned_and_foreign(folder, _files(folder))
            _remove_stale(folder, owned - {MARKER})
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_json(folder / MARKER, {"kvtwin": "run folder", "started": started, "foreign": sorted(foreign)})
            write_text(folder / INCOMPLETE, f"kvtwin run started {started} has not finished (or was killed); "
                                            f"its files here may be partial.\n")
        except OSError as e:
            raise OutputFolderError(f"{folder}: cannot prepare the output folder ({e.strerror or e})") from None
        try:
            with confined_to(folder):
                yield folder
        except BaseException:
            # the run's worker processes have ended by now: drop any temp file a write of theirs left
            _remove_temp_files(folder, foreign)
            raise
        written = sorted(_files(folder) - foreign - _OWN)
        write_json(folder / MARKER, {"kvtwin": "run folder", "started": started, "finished":
                                     time.strftime("%Y-%m-%dT%H:%M:%S%z"), "foreign": sorted(foreign),
                                     "files": written})
        (folder / INCOMPLETE).unlink(missing_ok=True)
