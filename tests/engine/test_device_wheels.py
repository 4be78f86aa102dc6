"""The wheel set the GPU check carries is complete for a bare Python: scripts/device_wheels.sh
downloads it from PyPI (for this interpreter's version here, so the compiled pydantic-core
imports; the script builds the 3.12 set the same way), then it is installed exactly as on the
device (`pip install --no-index --no-deps --target`) and imported by a Python started with -S
(no site-packages: nothing of this venv can fill a gap). Skipped when PyPI is unreachable.

It downloads, so the unit suite deselects it (the `network` marker, pyproject's addopts): run it
with `python -m pytest -m network tests/engine/test_device_wheels.py` before a GPU check."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NETWORK_ERRORS = ("Could not fetch", "NewConnectionError", "Temporary failure in name resolution",
                  "Max retries exceeded", "Network is unreachable", "ConnectionError")


@pytest.mark.network
def test_wheel_set_installs_and_imports_in_a_bare_python(tmp_path):
    wheels, site = tmp_path / "whl", tmp_path / "site"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PY_VERSION": version, "WHEEL_DIR": str(wheels)}
    proc = subprocess.run(["bash", "scripts/device_wheels.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode and any(e in proc.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"PyPI unreachable, the wheels cannot be downloaded: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {p.name.split("-")[0].lower() for p in wheels.glob("*.whl")}
    assert {"simpy", "pydantic", "pydantic_core", "typing_extensions", "annotated_types"} <= names
    assert len(names) == len(list(wheels.glob("*.whl")))          # one version of each
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              "--no-compile", "--target", str(site), *map(str, wheels.glob("*.whl"))],
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import simpy, pydantic\n"
            "class M(pydantic.BaseModel):\n    x: int\n"
            "assert M(x='3').x == 3 and simpy.Environment().now == 0\n"
            "assert all(m.__file__.startswith(sys.argv[1]) for m in (simpy, pydantic))")
    bare = subprocess.run([sys.executable, "-S", "-c", code, str(site)], capture_output=True, text=True,
                          timeout=60)
    assert bare.returncode == 0, bare.stderr[-3000:]
