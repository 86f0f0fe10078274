#!/usr/bin/env bash
# Run the whole test suite on this machine: CPU/gloo always, NCCL too when >= 2 GPUs are present.
# Installs the pinned requirements first if they are missing. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" - <<'PY' 2>/dev/null
import re, sys
from importlib.metadata import version
pins = [l.split("#")[0].strip() for l in open("requirements.txt")]
pins = [p for p in pins if p]
for pin in pins:
    name, want = re.split(r"==", pin)
    if version(name).split("+")[0] != want:
        sys.exit(1)
PY
then
  echo "Installing the pinned requirements (requirements.txt)..."
  "$PYTHON" -m pip install --quiet -r requirements.txt
fi

exec "$PYTHON" -m tensor_parallel_toy test "$@"
