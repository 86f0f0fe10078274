#!/usr/bin/env bash
# Run the profile with its defaults (TP=2, four modes, overlap benchmark, timeline) and write
# results/. Installs the pinned requirements first if they are missing. Extra arguments go to
# the profile, e.g. `bash run_profile.sh --steps 100 --out my_results`.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

source tensor_parallel_toy/ensure_requirements.sh

exec "$PYTHON" -m tensor_parallel_toy profile "$@"
