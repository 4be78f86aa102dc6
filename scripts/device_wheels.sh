#!/usr/bin/env bash
# Wheels the GPU machine's image lacks, for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored):
# simpy and pydantic at the versions installed here, with everything they need resolved by pip
# for the target (pydantic-core, annotated-types, typing-inspection, and typing-extensions: the
# image has one, possibly older than pydantic needs, so the set carries its own, which shadows
# the image's on PYTHONPATH). The set is complete for a bare Python 3.12: the script checks that
# it installs with --no-index, and tests/test_device_wheels.py installs and imports it
# (`pytest -m network`: the unit suite does not download).
# The device tool carries it with `carry: [".whl"]`; see docs/gpu_check.md.
#   PY_VERSION (3.12)  target Python;   WHEEL_DIR (.whl)  where the wheels go;   PYTHON (python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}
WHEEL_DIR=${WHEEL_DIR:-.whl}
REQUIREMENTS=$($PY - <<'PY'
from importlib import metadata
print(" ".join(f"{name}=={metadata.version(name)}" for name in ("simpy", "pydantic")))
PY
)
TARGET=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR"
# No --no-deps: pip resolves the requirements (one version of each) for the target Python.
# No local find-links or extra indexes: the set must come from PyPI as the GPU machine would need it.
$PY -m pip download -q --disable-pip-version-check --no-cache-dir --isolated --index-url https://pypi.org/simple "${TARGET[@]}" \
  -d "$WHEEL_DIR" $REQUIREMENTS
# Completeness: resolve the same requirements from the set alone, as the device's install will.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
$PY -m pip install -q --disable-pip-version-check --isolated --dry-run --no-index --find-links "$WHEEL_DIR" --target "$check" \
  "${TARGET[@]}" $REQUIREMENTS
ls "$WHEEL_DIR"
