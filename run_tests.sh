#!/usr/bin/env bash
# Run the whole test suite on this machine: CPU/gloo always, NCCL too when >= 2 GPUs are present.
# Installs the pinned requirements first if they are missing. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

source tensor_parallel_toy/ensure_requirements.sh

exec "$PYTHON" -m tensor_parallel_toy test "$@"
