#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has torch, triton, numpy, pandas, matplotlib,
# scipy, pyyaml, rich, safetensors), for Python 3.12 on x86-64, into .whl/ (git-ignored).
# The device tool carries them with `carry: [".whl"]`; see the README's "GPU check".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pydantic_core=$($PY - <<'PY'
from importlib import metadata
req = [r for r in metadata.requires("pydantic") if r.startswith("pydantic-core")][0]
print(req.split(";")[0].replace(" ", ""))
PY
)
pydantic=$($PY -c "from importlib import metadata; print('pydantic==' + metadata.version('pydantic'))")
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl simpy==4.1.2 "$pydantic" "$pydantic_core" annotated-types typing-inspection
ls .whl
