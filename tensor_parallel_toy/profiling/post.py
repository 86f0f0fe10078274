"""The blog posts, rendered from templates whose numbers come from the measurements.

`blog/src/<post>.md` is the text a writer edits. Every measured or derived number in it is a
placeholder, `{{name}}`, naming one entry of `values(blog_dir)`, which reads the committed
profile runs (`blog/results/`, `blog/link/`, `blog/llama/`, `blog/2d/`) and the formulas in
`memory_model.py`. `python -m tensor_parallel_toy blog` writes `blog/<post>.md` from them.
The tests check that the committed posts equal a fresh rendering, and that a template holds no
hand-typed measurement (`hand_typed_numbers`): a number copied into prose by hand would stay
behind when the results change; a placeholder cannot.
"""
import json
import os
import re

POSTS = ("part1-tp-and-sp.md", "part2-overlap-and-real-models.md")
HEADER = ("<!-- Rendered from blog/src/{name} by `python -m tensor_parallel_toy blog`, with the "
          "numbers of the committed profile runs: edit the source, not this file. -->\n")

MIB = 2 ** 20
SOURCES = {  # placeholder prefix: the committed results file it reads, relative to blog/
    "run": "results/results.json",            # the default profile run
    "link1g": "link/results_1gbit.json",      # the same over an emulated 1 Gbit/s link
    "loopback": "link/results_loopback.json",  # its loopback twin, same day
    "sweep": "link/sweep.json",               # tp and tp_overlap against the link rate
    "llama": "llama/results.json",            # --model llama: SwiGLU, Hugging Face's Llama
    "2d": "2d/results.json",                  # --dp 2: FSDP2 x TP on 4 ranks
}
_PLACEHOLDER = re.compile(r"\{\{\s*(?:([a-z0-9]+):)?([^|}]+?)\s*(?:\|\s*([^}]+?)\s*)?\}\}")


def _ratio(entry):
    """A ratio of results.json as `0.95 [0.89–0.99]`: median of paired steps, 95 % interval."""
    low, high = entry["ci95"]
    return f"{entry['ratio']:.2f} [{low:.2f}–{high:.2f}]"


FORMATS = {  # named formats; anything else after `|` is a Python format spec
    "ms": lambda v: f"{v * 1e3:.1f}",        # seconds -> ms
    "mib": lambda v: f"{v / MIB:.2f}",       # bytes -> MiB
    "mib1": lambda v: f"{v / MIB:.1f}",
    "pct": lambda v: f"{v * 100:.0f} %",
    "bytes": lambda v: f"{int(v):,}",
    "int": lambda v: f"{int(round(v))}",
    "ratio": _ratio,
}


def _lookup(data, path, where):
    """`data` at a dotted path; a segment that is an integer indexes a list (-1: the last)."""
    value = data
    for part in path.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise KeyError(f"{where}: {path!r} has no {part!r}") from None
    return value


def _format(value, fmt, where):
    if fmt is None:
        return str(value)
    if fmt in FORMATS:
        return FORMATS[fmt](value)
    try:
        return format(value, fmt)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: cannot format {value!r} with {fmt!r}: {e}") from None


def derived(blog_dir, data):
    """Named numbers that are not one entry of a results file: computed from them or from the
    package's formulas. Each is written once, here."""
    from . import memory_model

    out = {}
    run = data["run"]
    model, cfg = run["config"]["model"], run["config"]["run"]
    shape = dict(s=cfg["seq"], b=cfg["batch"], h=model["hidden_size"], f=model["ffn_hidden_size"],
                 a=model["num_heads"])
    p = run["meta"]["tp"]
    for name, kwargs in {"one": dict(p=1), "tp_only": dict(p=p, sequence_parallel=False),
                         "tp_sp": dict(p=p)}.items():
        elements = sum(e for _, _, e in memory_model.block_saved_elements(**shape, **kwargs))
        out[f"block_mib.{name}"] = f"{elements * 4 / MIB:.2f}"
    return out


def values(blog_dir):
    """{source name: its parsed results}, for the sources present, plus `derived`."""
    data = {}
    for name, rel in SOURCES.items():
        path = os.path.join(blog_dir, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data[name] = json.load(f)
    return data, derived(blog_dir, data)


def render(template, data, named, source="template"):
    """`template` with every placeholder replaced: `{{src:path|fmt}}` is the entry at `path` of
    results source `src`, formatted; `{{name}}` is `named[name]`. An unknown source, path or
    name is an error naming its line, so a typo can never render as text."""
    def replace(match):
        src, path, fmt = match.groups()
        where = f"{source}, line {template.count(chr(10), 0, match.start()) + 1}"
        if src is None:
            if path not in named:
                raise KeyError(f"{where}: unknown placeholder {{{{{path}}}}}")
            return named[path]
        if src not in data:
            raise KeyError(f"{where}: unknown results source {src!r} (have {sorted(data)})")
        return _format(_lookup(data[src], path, where), fmt, where)
    return _PLACEHOLDER.sub(replace, template)


def rendered_posts(blog_dir):
    """{post file name: the text it should have}, from blog/src and the committed results."""
    data, named = values(blog_dir)
    posts = {}
    for name in POSTS:
        with open(os.path.join(blog_dir, "src", name), encoding="utf-8") as f:
            template = f.read()
        posts[name] = HEADER.format(name=name) + render(template, data, named, f"blog/src/{name}")
    return posts


def write_posts(blog_dir):
    written = []
    for name, text in rendered_posts(blog_dir).items():
        path = os.path.join(blog_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(path)
    return written


# Prose, not code: what is left of a template once code, links, comments and placeholders go.
_FENCED = re.compile(r"^(`{3,}|~{3,}).*?^\1\s*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]+`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")


def hand_typed_numbers(template, allowed=()):
    """Numbers in a template's prose that look measured: anything with a decimal point, a
    thousands separator or an exponent, or an integer of 3 or more digits, unless it is in
    `allowed` (years, arXiv numbers, the constants a writer may state). Small integers stay
    legal: section numbers, p = 2, "four collectives". Code blocks, inline code and link
    targets are not prose."""
    prose = _PLACEHOLDER.sub(" ", template)
    for pattern in (_FENCED, _COMMENT, _INLINE_CODE, _LINK_TARGET):
        prose = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    found = []
    for line_no, line in enumerate(prose.splitlines(), 1):
        for m in _NUMBER.finditer(line):
            n = m.group(0).rstrip(",")
            looks_measured = any(c in n for c in ".,e") or len(n) >= 3
            if looks_measured and n not in allowed:
                found.append((line_no, n))
    return found
