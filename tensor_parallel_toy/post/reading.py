"""How long the posts take a learner, by a formula fitted on learners' logs kept per section.

What is timed. A learner who knows PyTorch and nanoGPT, but has never trained on more than one
device, reads the core to answer four checks: why each backward is the other collective; the
half-collectives of a block with and without SP; the four overlap bounds; a plan, launch and
check for their own nanoGPT. Each keeps a log of the minutes per section: reading, re-reading,
studying the figures, mapping code and following each formula, the pencil checks apart (the
posts say those come on top). That is study, not reading: the minutes are about three times
what the same words take at a reading pace.

The formula, fitted on CALIBRATION (six such logs, two learners on each of three versions of
the sixth edition's core, section by section, with each section's counts) by least squares on
each version's mean minutes per section:

    minutes = prose words / 45 + code words / 25 + 3.5 per figure shown + 0.15 per formula

A formula is a backtick span that holds an operator (`=`, `≤`, `·`, `/`, `+`, `−`, a sum, a
power or a shape like `2h`; not a file name, a flag, a keyword argument or a call), or a line
of a fenced block that is not Python or shell (equations, the worked example's matrices,
diagrams). `fit` solves the least squares and rounds (words a minute to 5, a figure's minutes to
0.5, a formula's to 0.01); the constants below are its result. How it does, per whole reading
of the core (pencil checks aside; the deep dives a learner opened aside too, being read only in
part, and counted below):

    version (commit)   predicted   learners, measured            their mean
    first (2c9f6b2)        144      139, 164, and a third's 137      147
    second (0f50fa7)       143      159, 125                         142
    third (f737369)        150      153, 153                         153
    per section (58), root-mean-square error: 1.7 minutes
    fourth (c5bae26)       153      134, 139                         137   (CHECKS: not fitted)
    fifth (4ccdf75)        155      151, 157                         154   (CHECKS: not fitted)
    sixth (d659a4f)        156      151, 160                         156   (CHECKS: not fitted)

The third version's two logs were taken as a check of the formula fitted on the first two (45,
25, 3.5, 0.17: it stated 152 minutes), then added; the later ones are kept out of the fit,
checks of this one (the sixth's first learner read one deep dive by mistake: 3 minutes, left
out). Learners differ: two of them on the same text, 125 and 159 minutes. The formula predicts
each version's mean within 15 % (the test holds it), not each learner's. The first version's
learners also opened deep dives for what its core lacked (the plan's check call, the sizes that
must divide, the second ring's figure: 16 and 22 minutes), which the second moved into its
core; later learners opened none. Two earlier logs, kept under a looser protocol (minutes to
read, without the checks' standard of understanding), are left out: the fourth edition (all but
its appendix: 10,356 prose words, 1,081 of code, 8 figures, 182 formulas) took 150 minutes (167
with its pencil checks), where this formula says 329; the fifth edition's core (5,457, 292, 6,
96) took 102, where it says 168. The constants are a calibration on six learners' logs, not a law.

Words are whitespace-separated, as `wc -w` counts them; HTML comments (the excerpt tags) are
not read. A figure that is only linked, `[figure](x.png)`, is not counted: the reader chooses.

The posts are cut into a core, which the posts ask everyone to read, and deep dives: a deep
dive is a section whose heading starts with "Deep dive" (after its number, if any) and runs to the next heading of its
level or above; the references are neither. A template states times with placeholders that
`fill_times` replaces once the rest is rendered (each renders as "N min", two words, counted
as two words while the times are computed):

    {{time:dive}}   in a deep dive's heading: that deep dive's time
    {{time:core}}   the core of all posts, together
    {{time:all}}    all posts, deep dives included, references not
    {{time:post}}   this post, deep dives included; {{time:postcore}}: this post's core
"""
import re

PROSE_WPM, CODE_WPM, MINUTES_PER_FIGURE, MINUTES_PER_FORMULA = 45, 25, 3.5, 0.15  # see `fit`

# The learners' logs, per version: (commit of the rendered posts they read, the whole readings
# of its core, (one row a section read: post, heading, prose words, code words, figures,
# formulas, then each learner's minutes, in the order of the whole readings))). Counted by
# `counts`; the headings of a part with no text of its own are left out. The first version's
# third whole reading comes without a log per section.
CALIBRATION = (
    ("2c9f6b2", (139, 164, 137), (
        ("1", "(opening)", 210, 0, 0, 0, 2, 3),
        ("1", "Launching, in ten lines", 138, 83, 0, 1, 5, 7),
        ("1", "Glossary and notation", 310, 0, 0, 4, 6, 7),
        ("1", "2. The collectives, drawn", 79, 0, 1, 1, 5, 6),
        ("1", "Two ways to cut one matrix multiplication", 244, 10, 1, 10, 7, 8),
        ("1", "A worked example on two ranks", 349, 31, 0, 7, 8, 9),
        ("1", "The conjugate pairs `f` and `g`", 125, 0, 0, 0, 3, 3),
        ("1", "Why each backward is the other collective", 230, 0, 1, 2, 10, 12),
        ("1", "What it shards", 221, 0, 1, 5, 9, 10),
        ("1", "What it costs in communication", 172, 0, 0, 3, 6, 7),
        ("1", "Why the backward pass re-gathers the saved local shard", 100, 0, 0, 3, 3, 4),
        ("1", "Norm weights under SP", 117, 0, 0, 1, 3, 5),
        ("1", "9. Your own model: a plan", 577, 190, 0, 19, 25, 28),
        ("1", "What part 1 built", 33, 0, 0, 0, 1, 1),
        ("2", "(opening)", 92, 0, 0, 1, 1, 2),
        ("2", "1. Hiding the communication under the GEMMs", 109, 0, 0, 1, 3, 5),
        ("2", "All-gather + GEMM as a ring", 108, 0, 1, 1, 8, 10),
        ("2", "The other ring, and the backward passes", 82, 0, 0, 0, 4, 5),
        ("2", "2. What overlap can save: four bounds", 524, 0, 0, 29, 18, 18),
        ("2", "3. When overlap pays on a GPU: a back-of-envelope", 478, 48, 0, 21, 12, 14),
    )),
    ("0f50fa7", (159, 125), (
        ("1", "(opening)", 215, 0, 0, 0, 2, 2),
        ("1", "Launching", 159, 17, 0, 1, 4, 4),
        ("1", "Glossary and notation", 269, 0, 0, 3, 6, 5),
        ("1", "2. The collectives, drawn", 90, 0, 1, 1, 7, 6),
        ("1", "Two ways to cut one matrix multiplication", 244, 10, 1, 10, 9, 7),
        ("1", "A worked example on two ranks", 349, 31, 0, 7, 10, 8),
        ("1", "The conjugate pairs `f` and `g`", 132, 0, 0, 0, 4, 4),
        ("1", "Why each backward is the other collective", 230, 0, 1, 2, 10, 8),
        ("1", "What it shards", 257, 0, 1, 6, 8, 8),
        ("1", "What it costs in communication", 207, 0, 0, 3, 8, 7),
        ("1", "Why the backward pass re-gathers the saved local shard", 100, 0, 0, 3, 4, 3),
        ("1", "Norm weights under SP", 117, 0, 0, 1, 5, 4),
        ("1", "9. Your own model: a plan", 790, 215, 0, 21, 30, 25),
        ("1", "What part 1 built", 33, 0, 0, 0, 1, 1),
        ("2", "(opening)", 91, 0, 0, 1, 2, 1),
        ("2", "1. Hiding the communication under the GEMMs", 101, 0, 0, 1, 4, 3),
        ("2", "All-gather + GEMM as a ring", 145, 0, 1, 4, 10, 8),
        ("2", "The other ring, and the backward passes", 171, 0, 1, 3, 10, 7),
        ("2", "2. What overlap can save: four bounds", 643, 0, 0, 31, 25, 14),
    )),
    ("f737369", (153, 153), (
        ("1", "(opening)", 215, 0, 0, 0, 3, 3),
        ("1", "Launching", 159, 17, 0, 1, 5, 4),
        ("1", "Glossary and notation", 269, 0, 0, 3, 6, 5),
        ("1", "2. The collectives, drawn", 90, 0, 1, 1, 6, 6),
        ("1", "Two ways to cut one matrix multiplication", 244, 10, 1, 10, 8, 8),
        ("1", "A worked example on two ranks", 349, 31, 0, 7, 7, 6),
        ("1", "The conjugate pairs `f` and `g`", 131, 0, 0, 0, 4, 4),
        ("1", "Why each backward is the other collective", 277, 0, 1, 2, 12, 12),
        ("1", "What it shards", 257, 0, 1, 6, 10, 8),
        ("1", "What it costs in communication", 207, 0, 0, 3, 7, 8),
        ("1", "Why the backward pass re-gathers the saved local shard", 100, 0, 0, 3, 4, 4),
        ("1", "Norm weights under SP", 117, 0, 0, 1, 4, 4),
        ("1", "9. Your own model: a plan", 937, 215, 0, 23, 30, 35),
        ("1", "What part 1 built", 33, 0, 0, 0, 1, 1),
        ("2", "(opening)", 91, 0, 0, 1, 2, 2),
        ("2", "1. Hiding the communication under the GEMMs", 101, 0, 0, 1, 4, 4),
        ("2", "All-gather + GEMM as a ring", 158, 0, 1, 4, 10, 9),
        ("2", "The other ring, and the backward passes", 199, 0, 1, 4, 10, 10),
        ("2", "2. What overlap can save: four bounds", 675, 0, 0, 32, 20, 20),
    )),
)
# Whole readings of later versions, kept out of the fit to check it: (commit, minutes).
CHECKS = (("c5bae26", (134, 139)), ("4ccdf75", (151, 157)), ("d659a4f", (151, 160)))
DEEP_DIVE = "Deep dive"
NOT_READ = ("References",)  # headings of sections a reader looks up, not reads

FENCED = re.compile(r"^(`{3,}|~{3,}).*?^\1\s*$", re.S | re.M)  # a code block
_SPAN = re.compile(r"`([^`\n]+)`")
_OPERATOR = re.compile(r"[=≤≥<>·×/+−Σ^]|\d[a-zA-Z]|\w - \w")
_CODE_NOT_FORMULA = re.compile(r"^[\w.]+=\S+$|^[\w./-]+\.(py|md|png|json|txt)$|^--|^[\w.]+\(.*\)$")
COMMENT = re.compile(r"<!--.*?-->", re.S)  # not shown, not read
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.M)
_TIME = re.compile(r"\{\{\s*time:(dive|core|all|post|postcore)\s*\}\}")


def is_deep_dive(title):
    """A heading's text (section number aside) that starts with "Deep dive"."""
    return re.match(r"(\d+\.\s+)?" + DEEP_DIVE, title) is not None


def _fence(block):
    return block.split("\n", 1)[0].strip("`~ ")


def formulas(text):
    """Formulas a reader checks: backtick spans in prose that hold an operator (not a file name,
    a flag, a keyword argument or a call), and the lines of fenced blocks that are not Python or
    shell (equations, the worked example's matrices, diagrams)."""
    text = COMMENT.sub(" ", text)
    n = 0
    for m in FENCED.finditer(text):
        if _fence(m.group(0)) not in ("python", "bash"):
            n += sum(1 for line in m.group(0).splitlines()[1:-1] if line.strip())
    spans = _SPAN.findall(FENCED.sub(" ", text))
    return n + sum(1 for s in spans if _OPERATOR.search(s) and not _CODE_NOT_FORMULA.match(s))


def counts(text):
    """(prose words, code words, figures shown, formulas) of `text` (markdown)."""
    text_read = COMMENT.sub(" ", text)
    code = sum(len(m.group(0).split()) for m in FENCED.finditer(text_read))
    return (len(text_read.split()) - code, code, len(re.findall(r"!\[", text_read)),
            formulas(text))


def predict(prose, code, figures, formula_count, constants=None):
    """Minutes from the counts, by the constants in use or by `constants`, (prose words a
    minute, code words a minute, minutes a figure, minutes a formula)."""
    prose_wpm, code_wpm, per_figure, per_formula = constants or (
        PROSE_WPM, CODE_WPM, MINUTES_PER_FIGURE, MINUTES_PER_FORMULA)
    return (prose / prose_wpm + code / code_wpm + figures * per_figure
            + formula_count * per_formula)


def minutes(text):
    """The formula's minutes for `text` (markdown)."""
    return predict(*counts(text))


def fit(data=CALIBRATION):
    """(prose words a minute, code words a minute, minutes a figure, minutes a formula): the
    least squares of the learners' mean minutes per section on the four counts (no constant
    term), over every version's sections, rounded as the module's docstring says."""
    import numpy as np

    sections_read = [row for _, _, rows in data for row in rows]
    rows = np.array([row[2:6] for row in sections_read], dtype=float)
    mean = np.array([sum(row[6:]) / len(row[6:]) for row in sections_read], dtype=float)
    per_prose, per_code, per_figure, per_formula = np.linalg.lstsq(rows, mean, rcond=None)[0]
    return (5 * round(1 / per_prose / 5), 5 * round(1 / per_code / 5),
            round(2 * float(per_figure)) / 2, round(float(per_formula), 2))


def sections(text):
    """[(level, title, body)] in order: the text before the first heading is level 0, title
    ''; each heading's body runs to the next heading of any level (a section's subsections
    are sections of their own)."""
    out, start, level, title = [], 0, 0, ""
    fenced = [m.span() for m in FENCED.finditer(text)]
    for m in _HEADING.finditer(text):
        if any(a <= m.start() < b for a, b in fenced):
            continue  # a comment line in a code block, not a heading
        out.append((level, title, text[start:m.start()]))
        level, title, start = len(m.group(1)), m.group(2).strip(), m.start()
    out.append((level, title, text[start:]))
    return out


def timed_parts(text):
    """{'core': minutes, 'dives': [(heading, minutes)], 'unread': minutes} of one post; a deep
    dive holds its subsections."""
    core, unread, dives = 0.0, 0.0, []
    enclosing = None  # (level, index in dives) of the deep dive or unread section we are in
    for level, title, body in sections(text):
        if enclosing is not None and level <= enclosing[0]:
            enclosing = None
        t = minutes(body)
        if enclosing is not None and is_deep_dive(title):
            raise ValueError(f"a deep dive inside another: {title!r}")
        if enclosing is None and is_deep_dive(title):
            dives.append([title, 0.0])
            enclosing = (level, len(dives) - 1)
        elif enclosing is None and title in NOT_READ:
            enclosing = (level, None)
        if enclosing is None:
            core += t
        elif enclosing[1] is None:
            unread += t
        else:
            dives[enclosing[1]][1] += t
    return {"core": core, "dives": [tuple(d) for d in dives], "unread": unread}


def stated(value):
    """How a time is written: whole minutes, half up, at least 1."""
    return f"{max(1, int(value + 0.5))} min"  # half up, as a reader rounds


def fill_times(posts):
    """{name: rendered text with its {{time:...}} placeholders} -> the same with the times.
    The placeholders are counted as the two words they become. Every deep dive's heading must
    state its time, and {{time:dive}} stands nowhere else."""
    parts = {name: timed_parts(_TIME.sub("0 min", text)) for name, text in posts.items()}
    core = sum(p["core"] for p in parts.values())
    values = {"core": core, "all": core + sum(t for p in parts.values() for _, t in p["dives"])}
    filled = {}
    for name, text in posts.items():
        dives = iter(t for _, t in parts[name]["dives"])
        values.update(postcore=parts[name]["core"],
                      post=parts[name]["core"] + sum(t for _, t in parts[name]["dives"]))
        lines = text.split("\n")
        for i, line in enumerate(lines):
            heading = _HEADING.match(line)
            if heading and is_deep_dive(heading.group(2)):
                if "time:dive" not in line:
                    raise ValueError(f"{name}: the deep dive {line.strip()!r} states no "
                                     "{{time:dive}}")
                dive = next(dives)
                line = _TIME.sub(lambda m: stated(dive) if m.group(1) == "dive"
                                 else m.group(0), line)
            elif "time:dive" in line:
                raise ValueError(f"{name}: {{{{time:dive}}}} outside a deep dive's heading: "
                                 f"{line.strip()!r}")
            lines[i] = _TIME.sub(lambda m: stated(values[m.group(1)]), line)
        filled[name] = "\n".join(lines)
    return filled
