"""The front door: a README a newcomer can scan, whose code runs and whose numbers are not stale.

- short: at most about 200 lines (details live in the rooms' READMEs and the posts);
- every Python block is an excerpt of an example under tensor_parallel_toy/examples/, verbatim
  (helpers.check_excerpts): a block that drifts from its file fails here; the training script
  is run here as a reader would, copied out of the README into another directory;
- no number that looks measured (the finder of post/render.py): measurements live in the
  committed results and the posts rendered from them;
- every relative link points at a file that exists;
- pyproject.toml pins what requirements.txt pins.
"""
import os
import re
import sys

import pytest

from tensor_parallel_toy.post import render as post

from .helpers import check_excerpts, parse_excerpts
from .processes import installed_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LINES = 200
ALLOWED_NUMBERS = {"3.10",  # the Python version the package needs
                   "2.13",  # the torch version pinned
                   "3.0", "3.2", "3.3", "2.5",  # versions in family names (Llama 3.2, Qwen2.5)
                   "580", "525", "579"}  # NVIDIA driver branches: which torch build each runs
_PYTHON_BLOCK = re.compile(r"^```python\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short():
    lines = _readme().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the front door keeps <= {MAX_LINES}"


def test_every_python_block_is_a_verbatim_excerpt_of_an_example():
    text = _readme()
    blocks = [i + 1 for i, line in enumerate(text.splitlines()) if _PYTHON_BLOCK.match(line)]
    tagged = parse_excerpts(text)
    assert len(tagged) == len(blocks) and blocks, (
        f"python blocks at lines {blocks}, excerpt tags before {len(tagged)} of them: every "
        f"Python block must be an excerpt of an example")
    for line, path, _ in tagged:
        assert path.startswith("tensor_parallel_toy/examples/"), (line, path)
    problems = check_excerpts(text, ROOT)
    assert not problems, "README excerpts out of sync with the examples:\n" + "\n".join(problems)


def test_readme_quotes_no_measured_number():
    found = post.hand_typed_numbers(_readme(), ALLOWED_NUMBERS)
    assert not found, (f"README.md: numbers that look measured (line, number): {found}; "
                       f"quote them in the posts, rendered from results")


def test_readme_links_point_at_files_that_exist():
    missing = [target for target in _LINK.findall(_readme())
               if "://" not in target and not os.path.exists(os.path.join(ROOT, target))]
    assert not missing, f"README.md links to missing files: {missing}"


def test_pyproject_pins_what_requirements_txt_pins():
    def pins(path):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            return set(re.findall(r"([A-Za-z0-9_.-]+==[0-9][\w.]*)", f.read()))
    assert pins("pyproject.toml") == pins("requirements.txt")


def _training_blocks():
    return [code for _, path, code in parse_excerpts(_readme())
            if path.endswith("examples/train_tp.py")]


def _copied_training_script(folder):
    """The README's training block saved alone in an empty directory, run with `python`."""
    script = os.path.join(folder, "readme_copy", "my_training.py")
    os.makedirs(os.path.dirname(script))
    with open(script, "w", encoding="utf-8") as f:
        f.write("".join(_training_blocks()[:1]) + "\n")
    return dict(argv=[sys.executable, script], cwd=os.path.dirname(script), env=installed_env())


BACKGROUND = {"readme_script": _copied_training_script}


@pytest.mark.background("readme_script")
def test_the_readme_training_script_runs_copied_into_another_directory(background):
    """The README's training block, as a reader copies it: saved alone in an empty directory
    and run with `python`, the package importable as after `pip install -e .`."""
    blocks = _training_blocks()
    assert len(blocks) == 1, f"README.md shows {len(blocks)} copies of train_tp.py, expected 1"
    code, out, err = background.result("readme_script")
    assert code == 0, out + err
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) >= 2 and "TP losses equal one device's" in out, out + err
