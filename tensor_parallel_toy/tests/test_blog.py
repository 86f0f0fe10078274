"""The blog post quotes the package verbatim: every tagged code excerpt must still be in its file.

An excerpt is a fenced code block preceded by a tag naming its source, relative to the
repository root:

    <!-- excerpt: tensor_parallel_toy/ring.py -->
    ```python
    def ring_all_gather(shard, ring, consume):
        ...
    ```

The block must appear in that file character for character (leading and trailing blank lines of
the block aside). When the code changes, the test names the excerpt that drifted, so the post is
updated in the same change. The post's image links must point at files that exist.
"""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOG = os.path.join(ROOT, "blog")
POST = os.path.join(BLOG, "tensor-parallel-deep-dive.md")

_TAG = re.compile(r"<!--\s*excerpt:\s*(\S+)\s*-->")
_FENCE = re.compile(r"^(`{3,}|~{3,})")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def parse_excerpts(text):
    """[(line number of the tag, source path, code)] for every tag in a Markdown text.

    A tag must be followed (blank lines allowed) by a fenced block; anything else is an error,
    so a tag can never silently check nothing.
    """
    lines = text.splitlines()
    excerpts = []
    for i, line in enumerate(lines):
        tag = _TAG.search(line)
        if not tag:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        fence = _FENCE.match(lines[j].strip()) if j < len(lines) else None
        if fence is None:
            raise ValueError(f"line {i + 1}: excerpt tag for {tag.group(1)} is not followed by "
                             f"a fenced code block")
        marker = fence.group(1)
        indent = len(lines[j]) - len(lines[j].lstrip())
        body = []
        for k in range(j + 1, len(lines)):
            if lines[k].strip().startswith(marker) and not lines[k].strip()[len(marker):].strip():
                break
            body.append(lines[k][indent:] if lines[k][:indent].isspace() else lines[k])
        else:
            raise ValueError(f"line {j + 1}: the code block after the excerpt tag for "
                             f"{tag.group(1)} is never closed")
        excerpts.append((i + 1, tag.group(1), "\n".join(body).strip("\n")))
    return excerpts


def check_excerpts(text, root):
    """Problems found, one line each: a missing source file or an excerpt not found in it."""
    problems = []
    for line_no, path, code in parse_excerpts(text):
        source_path = os.path.join(root, path)
        if not os.path.isfile(source_path):
            problems.append(f"line {line_no}: excerpt source {path} does not exist")
            continue
        with open(source_path, encoding="utf-8") as f:
            source = f.read()
        if not code.strip():
            problems.append(f"line {line_no}: the excerpt of {path} is empty")
        elif code not in source:
            first = code.splitlines()[0].strip()
            problems.append(f"line {line_no}: the excerpt of {path} starting {first!r} is not "
                            f"in the file any more (update the post)")
    return problems


def _post_text():
    assert os.path.isfile(POST), f"the blog post {POST} is missing"
    with open(POST, encoding="utf-8") as f:
        return f.read()


def test_blog_post_has_tagged_excerpts():
    excerpts = parse_excerpts(_post_text())
    assert excerpts, f"{POST} has no tagged code excerpts (<!-- excerpt: path --> + code block)"


def test_blog_excerpts_are_verbatim_from_the_package():
    problems = check_excerpts(_post_text(), ROOT)
    assert not problems, "blog excerpts out of sync with the code:\n" + "\n".join(problems)


def test_blog_images_exist():
    missing = [link for link in _IMAGE.findall(_post_text())
               if not re.match(r"[a-z]+://", link)
               and not os.path.isfile(os.path.join(BLOG, link))]
    assert not missing, f"images linked from the post but not in blog/: {missing}"


# The checker itself must be able to fail: drifted code, a wrong path, a tag without a block.
_SAMPLE_SOURCE = "def f(x):\n    return x + 1\n"


@pytest.mark.parametrize("post, expected", [
    ("<!-- excerpt: src.py -->\n```python\ndef f(x):\n    return x + 1\n```\n", None),
    ("<!-- excerpt: src.py -->\n\n```python\n\ndef f(x):\n    return x + 1\n\n```\n", None),
    ("<!-- excerpt: src.py -->\n```python\ndef f(x):\n    return x + 2\n```\n", "not in the file"),
    ("<!-- excerpt: src.py -->\n```python\ndef f(x):\n  return x + 1\n```\n", "not in the file"),
    ("<!-- excerpt: nope.py -->\n```python\ndef f(x):\n```\n", "does not exist"),
    ("<!-- excerpt: src.py -->\n```python\n\n```\n", "is empty"),
    ("<!-- excerpt: src.py -->\nSome prose.\n```python\ndef f(x):\n```\n", "not followed"),
    ("<!-- excerpt: src.py -->\n```python\ndef f(x):\n", "never closed"),
], ids=["verbatim", "blank-lines-aside", "drifted", "reindented", "missing-file", "empty",
        "no-block", "unclosed"])
def test_excerpt_checker_catches_drift(tmp_path, post, expected):
    (tmp_path / "src.py").write_text(_SAMPLE_SOURCE)
    try:
        problems = check_excerpts(post, str(tmp_path))
    except ValueError as e:
        problems = [str(e)]
    if expected is None:
        assert problems == [], problems
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_post_results_table_and_summary_match_the_committed_results_json():
    """The numbers of section 7 are those of blog/results/results.json: re-running the profile
    into blog/results without updating the post (or the other way round) fails here."""
    import json

    from tensor_parallel_toy.profiling import report

    with open(os.path.join(BLOG, "results", "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    with open(os.path.join(BLOG, "results", "summary.txt"), encoding="utf-8") as f:
        assert f.read() == report.summary_text(results), "summary.txt is not from results.json"
    with open(POST, encoding="utf-8") as f:
        post = f.read()
    mib = 2 ** 20
    for mode, d in results["modes"].items():
        mem = d["memory_per_rank"][0]
        state = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        t = d["step_time"]
        cells = [f"`{mode}`", f"{d['loss'][0]:.4f} → {d['loss'][-1]:.4f}",
                 f"{d['grad_norm'][-1]:.4f}",
                 f"{t['median'] * 1e3:.1f} [{t['p10'] * 1e3:.1f}–{t['p90'] * 1e3:.1f}]",
                 f"{d['tokens_per_s']:.0f}", f"{mem['saved_activation_bytes'] / mib:.2f}",
                 f"{state / mib:.2f}"]
        rows = [line for line in post.splitlines() if line.startswith(f"| `{mode}` |")]
        assert rows, f"the results table has no row for {mode}"
        missing = [c for c in cells if c not in rows[0]]
        assert not missing, f"{mode}: the post's row {rows[0]!r} lacks {missing} (results.json)"
