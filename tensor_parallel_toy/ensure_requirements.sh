# Sourced by run_tests.sh and run_profile.sh (from the repository root, with $PYTHON set):
# install the pins of requirements.txt unless every one of them is installed already.
if ! "$PYTHON" - <<'PY' 2>/dev/null
import re, sys
from importlib.metadata import version
pins = [l.split("#")[0].strip() for l in open("requirements.txt")]
for pin in filter(None, pins):
    name, want = re.split(r"==", pin)
    if version(name).split("+")[0] != want:  # 2.13.0+cpu satisfies torch==2.13.0
        sys.exit(1)
PY
then
  echo "Installing the pinned requirements (requirements.txt)..."
  "$PYTHON" -m pip install --quiet -r requirements.txt
fi
