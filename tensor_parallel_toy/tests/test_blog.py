"""The blog posts: their code quoted verbatim, their numbers measured, their figures current.

Excerpts. An excerpt is a fenced code block preceded by a tag naming its source, relative to the
repository root:

    <!-- excerpt: tensor_parallel_toy/ring.py -->
    ```python
    def ring_all_gather(shard, shard_consumer, ring):
        ...
    ```

The block must appear in that file character for character (leading and trailing blank lines of
the block aside). When the code changes, the test names the excerpt that drifted, so the post is
updated in the same change. The post's image links must point at files that exist.

Numbers. The posts are rendered from blog/src/ by `python -m tensor_parallel_toy blog`
(post/render.py): every measured number is a placeholder naming an entry of the committed
results. The committed posts must equal a fresh rendering, and the templates must hold no
number that looks measured outside the allow-list below.
"""
import os
import re
import subprocess

import pytest

from .helpers import check_excerpts, parse_excerpts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOG = os.path.join(ROOT, "blog")

# Numbers a writer may type: years, arXiv numbers, and constants that are not measurements.
ALLOWED_NUMBERS = {
    "2019", "2021", "2022", "2023", "2024", "2025",  # publication years
    "1909.08053", "2205.05198", "2104.04473", "2205.14135", "2211.05102",  # arXiv numbers
    "2105.05720", "2406.06858", "2409.15241", "2401.16677", "2310.01889", "2309.14509",
    "2407.21783",
    "1.09", "1.10",  # torchtitan's published async-TP speedups on H100, cited as such
    "500",  # the power limit (W) of torchtitan's H100s, cited with those speedups
    "175", "1.5", "0.18",  # the reading-time formula: prose words per minute, minutes per
    # table, minutes per formula
    "1.75",  # bound 3's 2 - 1/(pM) at p = 2, M = 2: arithmetic, not a measurement
    "370", "400",  # GB/s: NCCL's effective NVLink rate (nccl-tests#212); 8 NICs of 50 GB/s
    "3.10",  # the Python version the package needs
}

_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _posts():
    """{name: text} of the committed, rendered posts."""
    from tensor_parallel_toy.post import render as post

    texts = {}
    for name in post.POSTS:
        path = os.path.join(BLOG, name)
        assert os.path.isfile(path), f"the blog post {path} is missing"
        with open(path, encoding="utf-8") as f:
            texts[name] = f.read()
    return texts


def _package_lines():
    """Every stripped, non-trivial line of the package's Python files."""
    lines = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tensor_parallel_toy")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f), encoding="utf-8") as src:
                    lines.update(line.strip() for line in src if len(line.strip()) > 20)
    return lines


def test_code_quoted_from_the_package_is_tagged_so_its_drift_is_caught():
    """A Python block whose lines are the package's must carry an excerpt tag (an untagged
    quote would drift silently); blocks written for the post may stay untagged."""
    package = _package_lines()
    for name, text in _posts().items():
        tagged = {line for line, _, _ in parse_excerpts(text)}
        lines, untagged_quotes = text.splitlines(), []
        for i, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            if "excerpt:" in previous:
                continue
            block = []
            for body in lines[i + 1:]:
                if body.strip().startswith("```"):
                    break
                block.append(body.strip())
            quoted = [b for b in block if b in package]
            if len(quoted) >= 3:
                untagged_quotes.append((i + 1, quoted[0]))
        assert tagged, f"{name} has no tagged code excerpts"
        assert not untagged_quotes, (f"{name}: blocks quoting the package without an excerpt "
                                     f"tag (line, first quoted line): {untagged_quotes}")


def test_blog_excerpts_are_verbatim_from_the_package():
    problems = [f"{name}: {p}" for name, text in _posts().items()
                for p in check_excerpts(text, ROOT)]
    assert not problems, "blog excerpts out of sync with the code:\n" + "\n".join(problems)


# Corrections of issue 51's claim-by-claim check, each as the text that must (not) stand again.
_CORRECTED = [
    # (post, phrase that must not appear, why)
    ("part2", "its text says v4p", "the scaling book's example is TPU v5p"),
    ("part2", "crosses between the servers on one edge", "a ring spanning two servers crosses twice"),
    ("part2", "Among the nodes ready to run, autograd runs the one created last, so",
     "autograd's order is the engine's current behaviour, not a guarantee"),
    ("part2", "/docs/float8.md", "torchtitan's docs/float8.md is gone"),
    ("part1", "they must, to build the same full weights", "one generator state is this package's choice"),
    ("part2", "TP 2 pays\nwhile each all-reduce", "Llama 3 70B does not fit one H100: TP 8 against TP 4"),
    # what learners of the sixth edition stumbled on (a letter with two meanings, a miscount)
    ("part1", "with three concessions", "section 9 lists four concessions"),
    ("part1", "normalised `x·rms`", "the normalised input is x / rms(x)"),
    ("part1", "`Shard(d)`", "d is the head size; a placement's dimension is `dim`"),
    ("part2", "T_comm", "a layer's transfers are τc in every section, not T_comm"),
    ("part2", "`τc` the block's transfers", "bound 4's block transfers are σ, not a layer's τc"),
]


def test_the_corrected_claims_stay_corrected():
    """The phrasings a fact check corrected stay out of the posts, GitHub links to files or
    folders are pinned to a commit (never a branch), the scaling book is one reference, and the
    generation appendix cites its inference chapter."""
    from tensor_parallel_toy.post import render as post

    sources = {}
    for name in post.POSTS:
        with open(os.path.join(BLOG, "src", name), encoding="utf-8") as f:
            sources[name.split("-")[0]] = f.read()
    found = [(post_, phrase, why) for post_, phrase, why in _CORRECTED if phrase in sources[post_]]
    assert not found, f"corrected claims back in the posts: {found}"
    unpinned = [link for text in sources.values()
                for link in re.findall(r"https://github\.com/[^)\s]+/(?:blob|tree)/[^/)\s]+", text)
                if not re.search(r"/(?:blob|tree)/[0-9a-f]{40}$", link)]
    assert not unpinned, f"GitHub links to a branch, not a commit: {unpinned}"
    part2 = sources["part2"]
    assert part2.count("*How To Scale Your Model*") == 1, "the scaling book has two references"
    appendix = part2.split("appendix, generating text", 1)[1].split("## References", 1)[0]
    assert "scaling-book/inference" in appendix, "the generation appendix cites no inference chapter"
    bound4 = part2.split("4. **A block of rings", 1)[1].split("Real runs stay", 1)[0]
    assert "can reach" not in bound4 and "cannot go below `max(σ, κ)`" in bound4, (
        "bound 4: no schedule can go *below* max(σ, κ); it is a limit, not a reachable time")


def test_diffs_in_the_posts_add_the_lines_of_the_file_they_name():
    """A ```diff block tagged `<!-- diff: path -->` shows another project's code turned into
    ours: every `+` line must be a line of that file, as the excerpts are."""
    for name, text in _posts().items():
        for path, block in re.findall(r"<!-- diff: (\S+) -->\s*```diff\n(.*?)^```", text,
                                      flags=re.S | re.M):
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                lines = set(f.read().splitlines())
            added = [line[1:] for line in block.splitlines() if line.startswith("+")]
            assert added, f"{name}: a diff of {path} adds nothing"
            missing = [line for line in added if line not in lines]
            assert not missing, f"{name}: lines the diff adds but {path} does not hold: {missing}"


def test_blog_images_and_links_exist():
    missing = [f"{name}: {link}" for name, text in _posts().items()
               for link in _IMAGE.findall(text) + _LINK.findall(text)
               if not re.match(r"[a-z]+://|#", link)
               and not os.path.exists(os.path.join(BLOG, link.split("#")[0]))]
    assert not missing, f"images or files linked from the posts but not in blog/: {missing}"


def test_every_committed_figure_is_shown_or_linked_by_a_post():
    """A PNG under blog/ that no post references is a figure nobody reads: use it or delete it
    (a profile run into a folder the posts do not show writes figures nobody should commit)."""
    referenced = {os.path.normpath(link.split("#")[0]) for text in _posts().values()
                  for link in _IMAGE.findall(text) + _LINK.findall(text)}
    committed = {os.path.relpath(os.path.join(folder, f), BLOG)
                 for folder, _, files in os.walk(BLOG) for f in files if f.endswith(".png")}
    unused = sorted(committed - referenced)
    assert not unused, f"PNGs under blog/ that no post shows or links: {unused}"


def test_committed_posts_equal_a_fresh_rendering_of_their_templates():
    """Re-running the profile into blog/results, or editing blog/src, without running
    `python -m tensor_parallel_toy blog` fails here."""
    from tensor_parallel_toy.post import render as post

    for name, expected in post.rendered_posts(BLOG).items():
        with open(os.path.join(BLOG, name), encoding="utf-8") as f:
            committed = f.read()
        if committed != expected:
            diff = next(i for i, (a, b) in enumerate(zip(committed.splitlines() + [""],
                                                         expected.splitlines() + [""]))
                        if a != b)
            raise AssertionError(f"blog/{name} is not the rendering of blog/src/{name} with "
                                 f"the committed results (first difference at line {diff + 1}); "
                                 f"run `python -m tensor_parallel_toy blog`")


def test_templates_hold_no_hand_typed_measurement():
    from tensor_parallel_toy.post import render as post

    for name in post.POSTS:
        with open(os.path.join(BLOG, "src", name), encoding="utf-8") as f:
            found = post.hand_typed_numbers(f.read(), ALLOWED_NUMBERS)
        assert not found, (f"blog/src/{name}: numbers typed by hand (line, number): {found}; "
                           f"use a placeholder {{{{source:path|format}}}} (post/render.py)")


@pytest.mark.parametrize("template, expected", [
    ("The step took 12.5 ms.", [(1, "12.5")]),
    ("It sent\n1,048,576 bytes.", [(2, "1,048,576")]),
    ("An error of 3e-07 here.", [(1, "3e-07")]),
    ("It took 250 steps.", [(1, "250")]),
    ("Section 4, p = 2, four of 8 heads.", []),
    ("Measured {{run:meta.runtime_s|int}} s, in 2019.", []),
    ("```\ntook 12.5 ms\n```\nand `0.75` in code, [a](x/1.5.png)", []),
], ids=["decimal", "thousands", "exponent", "three-digits", "small-ints", "placeholder-year",
        "code-and-links"])
def test_hand_typed_number_finder(template, expected):
    from tensor_parallel_toy.post import render as post

    assert post.hand_typed_numbers(template, ALLOWED_NUMBERS) == expected


def test_render_fills_placeholders_and_refuses_unknown_ones():
    from tensor_parallel_toy.post import render as post

    data = {"run": {"a": {"b": [0.25, 0.123456]}, "r": {"ratio": 0.9, "ci95": [0.8, 0.95]}}}
    text = post.render("x {{run:a.b.-1|.3f}} y {{run:a.b.0|ms}} {{run:r|ratio}} {{n}}", data,
                       {"n": "N"})
    assert text == "x 0.123 y 250.0 0.90 [0.80–0.95] N"
    for bad, message in (("{{run:a.c}}", "has no 'c'"), ("{{nope:a}}", "unknown results source"),
                         ("\n{{missing}}", "line 2: unknown placeholder")):
        with pytest.raises(KeyError, match=message):
            post.render(bad, data, {})


# A ceiling on the core, so that it does not grow. A 75-minute core proved out of reach: the
# learners who studied the sixth edition's core to answer its four checks took 125 to 164
# minutes, and the sections each check needs take 18 to 40 minutes by the formula fitted on
# their logs (post/reading.py), the four together with what they share about 140. Raised from
# 155 to 160 for the drawn timeline of part 2's bounds 2 and 3 (a figure, 3.5 minutes by the
# formula, in place of an ASCII one that learners found hard to count).
CORE_MINUTES_MAX = 160


def test_the_core_stays_under_its_ceiling_and_every_stated_time_is_the_formulas():
    """Recomputed from the committed posts: the core of both parts (every section not marked as
    a deep dive, references aside) takes at most CORE_MINUTES_MAX by the fitted formula; part 1
    states it and the whole, part 2 its own two, and each deep dive its own, in its heading."""
    from tensor_parallel_toy.post import reading
    from tensor_parallel_toy.post.reading import stated

    posts = _posts()
    parts = {name: reading.timed_parts(text) for name, text in posts.items()}
    core = sum(p["core"] for p in parts.values())
    whole = core + sum(t for p in parts.values() for _, t in p["dives"])
    assert core <= CORE_MINUTES_MAX, (
        f"the core takes {core:.1f} minutes by the formula, over {CORE_MINUTES_MAX}")
    first, second = (posts[name] for name in sorted(posts))
    part1 = parts[sorted(posts)[0]]
    assert (f"The *core*, about {stated(core)}, is" in first
            and f"the rest of part 1 (about {stated(part1['core'])})" in first)
    assert f"Everything takes about {stated(whole)}, pencil" in first
    part2 = parts[sorted(posts)[1]]
    assert (f"about {stated(part2['core'] + sum(t for _, t in part2['dives']))} with its deep "
            f"dives; its core, sections 1 and 2, about\n{stated(part2['core'])}") in second
    for name, p in parts.items():
        assert p["dives"], f"{name} marks no deep dive"
        for heading, minutes in p["dives"]:
            assert heading.split(": ")[0].endswith(f"Deep dive, {stated(minutes)}"), (
                f"{name}: {heading!r} states another time than the formula's "
                f"{minutes:.1f} minutes")
            body = posts[name].split(heading, 1)[1].lstrip("\n")
            assert body.startswith("*Adds: "), f"{name}: {heading!r} does not say what it adds"


def _posts_at(commit):
    """{"1": part 1, "2": part 2} as rendered at `commit`; skips where the clone lacks it."""
    posts = {}
    for part, path in (("1", "blog/part1-tp-and-sp.md"),
                       ("2", "blog/part2-overlap-and-real-models.md")):
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT,
                               capture_output=True, text=True)
        if shown.returncode != 0:
            pytest.skip(f"this clone lacks commit {commit}, posts the learners read")
        posts[part] = shown.stdout
    return posts


def test_the_constants_are_the_fit_of_the_learners_logs_and_predict_each_versions_mean():
    """The constants in use are what `fit` finds on the calibration data; the formula predicts
    each version's mean whole reading within 15 %, and that of the later passes kept out of the
    fit; each log's sections add up to its whole reading; and the counts are those of the posts
    as the learners read them, where the clone has those commits."""
    from tensor_parallel_toy.post import reading

    assert reading.fit() == (reading.PROSE_WPM, reading.CODE_WPM, reading.MINUTES_PER_FIGURE,
                             reading.MINUTES_PER_FORMULA)
    mean = lambda minutes: sum(minutes) / len(minutes)  # noqa: E731
    for commit, whole, rows in reading.CALIBRATION:
        predicted = sum(reading.predict(*row[2:6]) for row in rows)
        logged = [sum(row[6 + i] for row in rows) for i in range(len(rows[0]) - 6)]
        assert logged == list(whole[:len(logged)]), commit
        assert abs(predicted / mean(whole) - 1) <= 0.15, (commit, predicted, whole)
        read = {(part, "(opening)" if level == 1 else title): reading.counts(body)
                for part, text in _posts_at(commit).items()
                for level, title, body in reading.sections(text)}
        for row in rows:
            assert read[row[0], row[1]] == row[2:6], (commit, row[:2])
    for commit, whole in reading.CHECKS:  # later learners, not in the fit
        core = sum(reading.timed_parts(text)["core"] for text in _posts_at(commit).values())
        assert abs(core / mean(whole) - 1) <= 0.15, (commit, core, whole)


def test_reading_time_formula_counts_each_kind_of_reading_at_its_rate():
    from tensor_parallel_toy.post import reading

    assert reading.minutes(" ".join(["word"] * 45)) == pytest.approx(1.0)
    code = "```python\n" + " ".join(["x"] * 23) + "\n```\n"  # 23 words and the two fences
    assert reading.minutes(code) == pytest.approx(1.0)
    # two formulas (an operator in each span), a file name and a keyword argument that are not
    assert reading.formulas("`a = b`, `2h`, `post/reading.py`, `overlap=True`, `x`") == 2
    assert reading.formulas("```\nY = X Wᵀ\n\nT = C + G\n```\n") == 2  # lines of an equation
    figure = "![a](b.png) and eight more words of prose in this line"
    assert reading.minutes(figure) == pytest.approx(3.5 + 10 / 45)  # the image is a word too
    assert reading.minutes("<!-- excerpt: a/b.py --> [figure](x.png)") == pytest.approx(1 / 45)
    text = ("intro words\n## A\none two three\n## Deep dive, 0 min: B\n"
            "four\n### sub\nfive six\n## References\nseven\n## C\neight\n")
    parts = reading.timed_parts(text)
    words = lambda n: n / 45  # noqa: E731
    # intro 2; A: 5 words with its heading; C: 3; the dive: 7 + 4; refs: 3
    assert parts["core"] == pytest.approx(words(2 + 5 + 3))
    assert parts["dives"] == [("Deep dive, 0 min: B", pytest.approx(words(11)))]
    assert parts["unread"] == pytest.approx(words(3))
    with pytest.raises(ValueError, match="inside another"):
        reading.timed_parts("## Deep dive, 0 min: a\n### Deep dive, 0 min: b\n")


@pytest.mark.parametrize("post, expected", [
    ("a\n## 3. Deep dive, {{time:dive}}: x\n" + "w " * 90 + "\n## Core\n{{time:core}}",
     "a\n## 3. Deep dive, 2 min: x\n" + "w " * 90 + "\n## Core\n1 min"),
    ("## Deep dive: x\nw\n", "states no {{time:dive}}"),
    ("## x {{time:dive}}\nw\n", "outside a deep dive's heading"),
], ids=["filled", "dive-without-time", "dive-time-elsewhere"])
def test_reading_times_are_filled_in_or_refused(post, expected):
    from tensor_parallel_toy.post import reading

    if "{{" in expected or "outside" in expected:
        with pytest.raises(ValueError, match=re.escape(expected)):
            reading.fill_times({"p.md": post})
    else:
        assert reading.fill_times({"p.md": post}) == {"p.md": expected}


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


def _committed_runs():
    """(results.json, its summary.txt) of the committed profile runs whose summaries are kept
    as the report writes them: blog/results, llama, 2d, and blog/halves' results_X/summary_X."""
    runs = [(os.path.join(BLOG, folder, "results.json"), os.path.join(BLOG, folder, "summary.txt"))
            for folder in ("results", "llama", "2d")]
    halves = os.path.join(BLOG, "halves")
    runs += [(os.path.join(halves, name), os.path.join(halves, "summary_" + name[8:-5] + ".txt"))
             for name in sorted(os.listdir(halves)) if name.startswith("results_")]
    return [(r, s) for r, s in runs if os.path.isfile(r) or r.endswith("results/results.json")]


def test_summary_txt_is_the_committed_results_json():
    import json

    from tensor_parallel_toy.profiling.report import report

    for path, summary in _committed_runs():
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        with open(summary, encoding="utf-8") as f:
            assert f.read() == report.summary_text(results), summary


def test_targets_in_results_json_are_what_their_numbers_give_today():
    """The targets' texts are stored in results.json; when their wording changes, the committed
    files must be re-rendered (their numbers kept) so that summary.txt prints the new one."""
    import json

    from tensor_parallel_toy.profiling.report import targets

    for path, _ in _committed_runs():
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        for stored, fresh in zip(results["targets"], targets.evaluate_targets(results)):
            assert stored == fresh, f"{path}: {stored} != {fresh}"


@pytest.mark.parametrize("s, b, h, n, p", [(4096, 1, 8192, 28672, 8), (2048, 4, 4096, 14336, 4),
                                           (512, 2, 1024, 1024, 2), (8192, 1, 16384, 53248, 16)])
def test_envelope_formula_equals_a_direct_count_of_bytes_and_flops(s, b, h, n, p):
    """T_comm / T_gemm = (p-1)·B·F / (2·n·bandwidth): the same as counting the p-1 ring steps'
    bytes and the rank's GEMM FLOPs, whatever s, b and h are."""
    from tensor_parallel_toy.post import envelope

    for link in (envelope.NVLINK_H100, envelope.INFINIBAND_NDR):
        t_comm, t_gemm = envelope.layer_times(s, b, h, n, p, link)
        formula = envelope.ratio(p, n, link)
        assert abs(t_comm / t_gemm - formula) <= 1e-12 * formula, (t_comm / t_gemm, formula)


def test_decode_envelope_compares_tp8_with_tp4_because_llama3_70b_does_not_fit_one_h100():
    """Llama 3 70B's bf16 weights (about 70.6 billion parameters, 141 GB) exceed one 80 GB H100,
    so TP 1 is no baseline; TP 4 fits. TP 8 reads half of TP 4's share of a block, and its two
    all-reduces may each cost half the time saved more than TP 4's."""
    from tensor_parallel_toy.post import envelope

    d = envelope.decode_tp8_vs_tp4()
    params = d["weights_gb"] * 1e9 / envelope.BF16
    assert 70.0e9 < params < 71.0e9, params
    assert d["weights_gb"] * 1e9 > envelope.H100_HBM_BYTES > d["tp4_gb"] * 1e9
    assert d["tp8_us"] == pytest.approx(d["tp4_us"] / 2)
    assert d["extra_us"] == pytest.approx((d["tp4_us"] - d["tp8_us"]) / 2)
