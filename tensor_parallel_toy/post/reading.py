"""How long the posts take a learner, by a formula calibrated on two learners' timed readings.

Reading. A learner who knew PyTorch and nanoGPT, but had never trained on more than one device,
read the fourth edition with a log kept per section: dense prose went at about 175 words a
minute, code at about 70, each figure one had to study (the regions of a block, the transposes,
each ring) took 3 to 5 minutes, a table about a minute and a half, and a passage the post asks
to be read twice took twice its time.

Understanding. Those rates alone stated 59 minutes for the fifth edition's core, which the
next learner took about 102 minutes to read (85 to 110), pencil checks aside; the sections where
one must think ran 2 to 3 times the rates (part 1 section 9, a plan, 13 minutes against 5; the
overlap bounds and the envelope, 17 against 9). Two things cost the extra time: a Python block
(mapping code onto the idea it implements, beyond reading its words) and a formula (a backtick
span that holds an operator, `=`, `≤`, `·`, `/`, `+`, `−`, a sum, a power or a shape like `2h`,
or a line of a fenced block that is not Python or shell), each of which a learner checks. The
formula:

    minutes = prose words / 175 + code words / 70 + 3 per figure shown + 1.5 per table
              + 3 per Python block + 0.18 per formula,
              counted twice in a section whose heading says "(read it twice)"

The two understanding constants are fitted on CALIBRATION, the learners' logs beside the counts
of the editions they read (`git show 4518f73:blog/part1-tp-and-sp.md`, the fourth edition as
read, stating 40 + 37 = 77 minutes; `b845c02`, the fifth, stating 59 for its core): `fit`
searches a = 0, 0.25, ..., 4 minutes per Python block and b = 0, 0.01, ..., 0.5 per formula for
the least squared relative error over the four logs, among the pairs that predict both
editions' totals within 15 %, and finds a = 3, b = 0.18:

    log                                            rates  Python  formulas  predicted  measured
    4th edition, all but its appendix (a)          112.1     9       182       171.9      150
    5th edition, the core                           59.4     5        96        91.6      102
    5th edition, part 1 section 9                    5.2     2         6        12.3       13
    5th edition, part 2 sections 2 and 3             8.6     0        42        16.1       17

(a) an estimate: that learner took 167 minutes with the pencil checks, which the log did not
time apart; the fifth edition's log put its checks at about 17, hence 150. With 167 the fit
gives a = 3.25, b = 0.2 and this edition's core 77.6 minutes instead of 74.9: the constants are
this uncertain.
The fourth edition comes out 15 % high and the fifth 10 % low: a learner reading the whole
post meets the same ideas as one reading the core, so the understanding term is not purely per
block and formula. The data are two learners: the constants are a calibration, not a law.

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

PROSE_WPM, CODE_WPM, MINUTES_PER_FIGURE, MINUTES_PER_TABLE = 175, 70, 3.0, 1.5
MINUTES_PER_PYTHON_BLOCK, MINUTES_PER_FORMULA = 3.0, 0.18  # fitted: see `fit`

# The learners' logs: (what was read, its minutes at the reading rates alone, Python blocks,
# formulas, measured minutes), counted by `reading_minutes`, `python_blocks` and `formulas` on
# the rendered posts of commits 4518f73 (the fourth edition as read) and b845c02 (the fifth).
CALIBRATION = (
    ("4th edition, all but its appendix", 112.12, 9, 182, 150),
    ("5th edition, the core", 59.35, 5, 96, 102),
    ("5th edition, part 1 section 9", 5.21, 2, 6, 13),
    ("5th edition, part 2 sections 2 and 3", 8.59, 0, 42, 17),
)
TOTALS = 2  # the first two logs are whole readings: the fit must predict them within 15 %
REREAD = "(read it twice)"
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


def python_blocks(text):
    """Fenced blocks of Python (excerpts and examples) in `text`, comments aside."""
    return sum(1 for m in FENCED.finditer(COMMENT.sub(" ", text)) if _fence(m.group(0)) == "python")


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


def reading_minutes(text):
    """The reading rates alone: prose, code, figures and tables."""
    text = COMMENT.sub(" ", text)
    code = sum(len(m.group(0).split()) for m in FENCED.finditer(text))
    prose = len(text.split()) - code
    figures = len(re.findall(r"!\[", text))
    tables = len(re.findall(r"^\|\s*:?-{3,}", text, flags=re.M))
    return (prose / PROSE_WPM + code / CODE_WPM + figures * MINUTES_PER_FIGURE
            + tables * MINUTES_PER_TABLE)


def predict(rates, python, formula_count, per_block=None, per_formula=None):
    """Minutes from the counts: the reading rates' minutes plus the understanding term."""
    per_block = MINUTES_PER_PYTHON_BLOCK if per_block is None else per_block
    per_formula = MINUTES_PER_FORMULA if per_formula is None else per_formula
    return rates + per_block * python + per_formula * formula_count


def minutes(text):
    """The formula's minutes for `text` (markdown), re-reading not included."""
    return predict(reading_minutes(text), python_blocks(text), formulas(text))


def fit(data=CALIBRATION, totals=TOTALS, tolerance=0.15):
    """(minutes per Python block, per formula): the grid point with the least squared relative
    error over `data` among those that predict its first `totals` logs within `tolerance`."""
    best = None
    for i in range(17):
        for j in range(51):
            a, b = i * 0.25, j * 0.01
            errors = [predict(r, py, f, a, b) / measured - 1 for _, r, py, f, measured in data]
            if max(abs(e) for e in errors[:totals]) <= tolerance:
                score = sum(e * e for e in errors)
                if best is None or score < best[0]:
                    best = (score, a, b)
    if best is None:
        raise ValueError(f"no constants predict the {totals} whole readings within {tolerance}")
    return best[1], best[2]


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
    """{'core': minutes, 'dives': [(heading, minutes)], 'unread': minutes} of one post. A
    section counts twice when its heading says REREAD; a deep dive holds its subsections."""
    core, unread, dives = 0.0, 0.0, []
    enclosing = None  # (level, index in dives) of the deep dive or unread section we are in
    for level, title, body in sections(text):
        if enclosing is not None and level <= enclosing[0]:
            enclosing = None
        t = minutes(body) * (2 if REREAD in title else 1)
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
