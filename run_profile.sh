#!/usr/bin/env bash
# Run the profile with its defaults (TP=2, four modes, overlap benchmark, timeline) and write
# results/. Installs the pinned requirements first if they are missing. Extra arguments go to
# the profile, e.g. `bash run_profile.sh --steps 100 --out my_results`.
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

exec "$PYTHON" -m tensor_parallel_toy profile "$@"
