"""How long the posts take to read, by a formula calibrated on a learner's timed reading.

A learner who knew PyTorch and nanoGPT, but had never trained on more than one device, read
the fourth edition with a log kept per section: dense prose went at about 175 words a minute,
code at about 70, each figure one had to study (the regions of a block, the transposes, each
ring) took 3 to 5 minutes, a table about a minute and a half, and a passage the post asks to be
read twice took twice its time. The formula:

    minutes = prose words / 175 + code words / 70 + 3 per figure shown + 1.5 per table,
              counted twice in a section whose heading says "(read it twice)"

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
REREAD = "(read it twice)"
DEEP_DIVE = "Deep dive"
NOT_READ = ("References",)  # headings of sections a reader looks up, not reads

FENCED = re.compile(r"^(`{3,}|~{3,}).*?^\1\s*$", re.S | re.M)  # a code block
COMMENT = re.compile(r"<!--.*?-->", re.S)  # not shown, not read
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.M)
_TIME = re.compile(r"\{\{\s*time:(dive|core|all|post|postcore)\s*\}\}")


def is_deep_dive(title):
    """A heading's text (section number aside) that starts with "Deep dive"."""
    return re.match(r"(\d+\.\s+)?" + DEEP_DIVE, title) is not None


def minutes(text):
    """The formula's minutes for `text` (markdown), re-reading not included."""
    text = COMMENT.sub(" ", text)
    code = sum(len(m.group(0).split()) for m in FENCED.finditer(text))
    prose = len(text.split()) - code
    figures = len(re.findall(r"!\[", text))
    tables = len(re.findall(r"^\|\s*:?-{3,}", text, flags=re.M))
    return (prose / PROSE_WPM + code / CODE_WPM + figures * MINUTES_PER_FIGURE
            + tables * MINUTES_PER_TABLE)


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
