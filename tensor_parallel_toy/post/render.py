"""The blog posts, rendered from templates whose numbers come from the measurements.

`blog/src/<post>.md` is the text a writer edits. Every measured or derived number in it is a
placeholder: `{{src:path|format}}` names an entry of one of the committed profile runs
(SOURCES: `blog/results/`, `blog/link/`, `blog/llama/`, `blog/2d/`, `blog/wire/`, `blog/decode/`,
`blog/halves/`), `{{name}}` a value that
`derived` computes from them or from the package's formulas (`memory_model.py`), and
`{{time:...}}` a reading time (reading.py). `python -m tensor_parallel_toy blog` writes
`blog/<post>.md` from them.
The tests check that the committed posts equal a fresh rendering, and that a template holds no
hand-typed measurement (`hand_typed_numbers`): a number copied into prose by hand would stay
behind when the results change; a placeholder cannot.
"""
import json
import os
import re

from ..profiling.measure.metrics import MiB
from . import envelope, reading

POSTS = ("part1-tp-and-sp.md", "part2-overlap-and-real-models.md")
HEADER = ("<!-- Rendered from blog/src/{name} by `python -m tensor_parallel_toy blog`, with the "
          "numbers of the committed profile runs: edit the source, not this file. -->\n")

SOURCES = {  # placeholder prefix: the committed results file it reads, relative to blog/
    "run": "results/results.json",            # the default profile run
    "link1g": "link/results_1gbit.json",      # the same over an emulated 1 Gbit/s link
    "loopback": "link/results_loopback.json",  # its loopback twin, same day
    "sweep": "link/sweep.json",               # tp and tp_overlap against the link rate
    "llama": "llama/results.json",            # --model llama: SwiGLU, Hugging Face's Llama
    "2d": "2d/results.json",                  # --dp 2: FSDP2 x TP on 4 ranks
    "wire": "wire/results_model_1gbit_m4.json",  # a MODELED 1 Gbit/s wire, rings in 4 pieces
    "wire4": "wire/results_model_1gbit_m4.json",  # the same, the rings in four pieces
    "decode": "decode/decode.json",           # generation's cost per token (run/decode.py)
    "decodelink": "decode/link_1gbit/decode.json",  # the same over an emulated 1 Gbit/s link
    "halves": "halves/results_model_1gbit.json",  # tp_halves on a MODELED 1 Gbit/s wire
    "halvesveth": "halves/results_veth_1gbit.json",  # the same over the emulated 1 Gbit/s link
    "halvesloop": "halves/results_loopback.json",  # the default run, loopback
    "gpu": "gpu/profile/results.json",        # gpu-check's profile step (--share-gpu: 1 GPU)
    "hf": "hf/hf_train.json",                 # Hugging Face decoders by their own plan, beside
}                                             # transformers' own TP (run/hf_train.py)
_PLACEHOLDER = re.compile(r"\{\{\s*(?:([a-z0-9]+):)?([^|}]+?)\s*(?:\|\s*([^}]+?)\s*)?\}\}")


def _ratio(entry):
    """A ratio of results.json as `0.95 [0.89–0.99]`: median of paired steps, 95 % interval."""
    low, high = entry["ci95"]
    return f"{entry['ratio']:.2f} [{low:.2f}–{high:.2f}]"


FORMATS = {  # named formats; anything else after `|` is a Python format spec
    "ms": lambda v: f"{v * 1e3:.1f}",        # seconds -> ms
    "mib": lambda v: f"{v / MiB:.2f}",       # bytes -> MiB
    "mib1": lambda v: f"{v / MiB:.1f}",
    "pct": lambda v: f"{v * 100:.0f} %",
    "gbit": lambda v: f"{v / 1e9:.2f}",     # bits/s -> Gbit/s
    "rate": lambda v: f"{v / 1e9:g} Gbit/s",
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


def _matrix(t):
    return str(t.tolist()).replace(".0,", ",").replace(".0]", "]")


def worked_example():
    """Part 1's two-rank example, computed: Y = X Wᵀ split by columns and by rows, and the
    column split's backward, whose per-rank terms of dX only sum to dX."""
    import torch

    x = torch.tensor([[1., 2., 0., 1.], [0., 1., 3., 2.]])  # [s·b=2, in=4]
    w = torch.tensor([[1., 0., 2., 1.], [0., 1., 1., 0.]])  # [out=2, in=4]
    dy = torch.tensor([[1., 1.], [1., 0.]])
    y = x @ w.t()
    parts = [x[:, :2] @ w[:, :2].t(), x[:, 2:] @ w[:, 2:].t()]  # row split: partial sums
    terms = [dy[:, r:r + 1] @ w[r:r + 1] for r in range(2)]  # column split: dX's terms
    assert torch.equal(parts[0] + parts[1], y) and torch.equal(terms[0] + terms[1], dy @ w)
    return {"ex.X": _matrix(x), "ex.W": _matrix(w), "ex.Y": _matrix(y), "ex.dY": _matrix(dy),
            "ex.col0": _matrix(y[:, :1]), "ex.col1": _matrix(y[:, 1:]),
            "ex.part0": _matrix(parts[0]), "ex.part1": _matrix(parts[1]),
            "ex.dx0": _matrix(terms[0]), "ex.dx1": _matrix(terms[1]), "ex.dX": _matrix(dy @ w),
            "ex.W0": _matrix(w[:, :2]), "ex.W1": _matrix(w[:, 2:]),
            "ex.dxr0": _matrix(dy @ w[:, :2]), "ex.dxr1": _matrix(dy @ w[:, 2:])}


def _max_rel(prefix, results, key="loss_rel_err_vs_baseline"):
    """Largest relative difference from the baseline over all steps, per mode and overall."""
    out, worst = {}, 0.0
    for mode, d in results["modes"].items():
        if d.get(key) is not None:
            value = max(d[key])
            out[f"{prefix}.{mode}"] = f"{value:.1e}"
            worst = max(worst, value)
    out[f"{prefix}.all"] = f"{worst:.1e}"
    return out


def _results_table(results):
    rows = []
    for mode, d in results["modes"].items():
        mem = d["memory_per_rank"][0]
        state = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        t = d["step_time"]
        rel = d.get("loss_rel_err_vs_baseline")
        rows.append(" | ".join([
            f"| `{mode}`", f"{d['loss'][0]:.4f} → {d['loss'][-1]:.4f}",
            "–" if rel is None else f"{max(rel):.1e}", f"{d['grad_norm'][-1]:.4f}",
            f"{t['median'] * 1e3:.1f} [{t['p10'] * 1e3:.1f}–{t['p90'] * 1e3:.1f}]",
            f"{d['tokens_per_s']:.0f}", f"{mem['saved_activation_bytes'] / MiB:.2f}",
            f"{state / MiB:.2f} |"]))
    return "\n".join(rows)


def _spread(d, digits=1):
    return f"{d['median']:.{digits}f} [{d['p10']:.{digits}f}–{d['p90']:.{digits}f}]"


def derived(data):
    """Named numbers that are not one entry of a results file: computed from them or from the
    package's formulas. Each is computed once, here."""
    from ..config import ModelConfig
    from ..profiling.measure import memory_model

    out = worked_example()
    out.update(envelope.named())
    run = data["run"]
    model, cfg = run["config"]["model"], run["config"]["run"]
    s, b, p = cfg["seq"], cfg["batch"], run["meta"]["tp"]
    h, B = model["hidden_size"], 4
    shape = dict(s=s, b=b, h=h, f=model["ffn_hidden_size"], a=model["num_heads"])
    for name, kwargs in {"one": dict(p=1), "tp_only": dict(p=p, sequence_parallel=False),
                         "tp_sp": dict(p=p)}.items():
        out[f"block_mib.{name}"] = f"{memory_model.block_mib(**shape, **kwargs):.2f}"
    config = ModelConfig(**model)
    modes = run["modes"]
    act = {m: d["memory_per_rank"][0]["saved_activation_bytes"] for m, d in modes.items()}
    formula = {"baseline": memory_model.model_saved_bytes(config, s, b, 1),
               "tp_sp": memory_model.model_saved_bytes(config, s, b, p),
               "tp_only": memory_model.model_saved_bytes(config, s, b, p,
                                                         sequence_parallel=False)}
    measured = {"baseline": act["baseline"], "tp_sp": act["tp"],
                "tp_only": run["memory_tp_no_sp"]["memory_per_rank"][0]["saved_activation_bytes"]}
    for name in formula:
        out[f"mem.formula.{name}"] = f"{formula[name]:,}"
        out[f"mem.measured.{name}"] = f"{measured[name]:,}"
    out["mem.tp_no_sp_mib"] = f"{measured['tp_only'] / MiB:.2f}"

    def state(mode):
        mem = modes[mode]["memory_per_rank"][0]
        return mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
    out["mem.tp_over_baseline.act"] = f"{act['tp'] / act['baseline']:.3f}"
    out["mem.tp_over_baseline.state"] = f"{state('tp') / state('baseline'):.3f}"
    # DTensor saves the gathered input of its 5 column layers (2 per block and the head).
    extra = act["dtensor"] - act["tp"]
    columns = 2 * model["num_layers"] + 1
    extra_formula = columns * (p - 1) * s * b * h * B // p
    out.update({"dtensor.extra_bytes": f"{extra:,}", "dtensor.extra_formula": f"{extra_formula:,}",
                "dtensor.extra_gap": f"{abs(extra - extra_formula):,}"})
    out.update(_max_rel("run.max_rel_loss", run))
    out.update(_max_rel("run.max_rel_grad_norm", run, "grad_norm_rel_err_vs_baseline"))
    for name in ("llama", "2d", "gpu"):
        if name in data:
            out.update(_max_rel(f"{name}.max_rel_loss", data[name]))
    if "decode" in data:  # its envelope reads bf16 weights; the measured model runs in fp32
        for key, value in data["decode"]["gpu_envelope"]["this model"].items():
            out[f"decode.fp32.{key}"] = f"{2 * value:.1f}"
    out["results_table"] = _results_table(run)
    for mode, summary in run["timeline"]["summary"].items():
        for key, label in (("total_ms", "total"), ("blocked_in_comm_ms", "blocked"),
                           ("posting_ms", "posting")):
            out[f"tl.{mode}.{label}"] = _spread(summary["over_recordings"][key])
    # Summed over the benchmark's four ops: what the ring's transport saves against gloo's
    # collectives (basic -> sequential), and what overlapping then saves (-> overlapped).
    ops = run["overlap_benchmark"]["ops"].values()
    out["bench.transport_ms"] = f"{sum(o['t_basic_ms'] - o['t_seq_ms'] for o in ops):.2f}"
    out["bench.overlap_ms"] = f"{sum(o['t_seq_ms'] - o['t_overlap_ms'] for o in ops):.2f}"
    from ..profiling.measure.bench_overlap import TARGET_COMM_OVER_GEMM
    out["bench.comm_over_gemm"] = f"{TARGET_COMM_OVER_GEMM:g}"
    out["bench.nothing_hidden"] = f"{1 + TARGET_COMM_OVER_GEMM:g}"
    if "sweep" in data:  # tp_overlap's step time over the larger of the sweep's two limits
        sweep = data["sweep"]
        for name, point in (("first", sweep["rates"][0]), ("last", sweep["rates"][-1])):
            # at the rate one TCP stream measured on the link, not its nominal rate
            comm_bound = sweep["bytes_per_step_derived"] * 8 / point["measured_bits_per_s"]
            limit = max(comm_bound, sweep["compute_bound_s"])
            out[f"sweep.over_limit.{name}"] = f"{point['tp_overlap']['median_s'] / limit:.2f}"
    for src in ("run", "link1g"):  # op time / max(comm, GEMM) over blocks of rounds
        for op, d in data.get(src, {}).get("overlap_benchmark", {}).get("ops", {}).items():
            for key, label in (("overlap_over_max_blocks", "ovl"), ("basic_over_max_blocks",
                                                                    "basic")):
                if key in d:
                    out[f"{label}.{src}.{op}"] = _spread(d[key], 2)
    return out


def _gpu_check(blog_dir):
    """gpu-check's test steps, from their JUnit reports in blog/gpu/: tests passed per step."""
    from ..launcher.gpu_report import read_report
    out = {}
    for step in ("nccl-tests", "sanitizer"):
        tests = read_report(os.path.join(blog_dir, "gpu", f"{step}.xml"), "nccl")
        if tests.counts:
            out[f"gpu.{step}.passed"] = str(tests.backend_passed)
    return out


def values(blog_dir):
    """({source name: its parsed results}, for the sources present; `derived` of them)."""
    data = {}
    for name, rel in SOURCES.items():
        path = os.path.join(blog_dir, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data[name] = json.load(f)
    return data, {**derived(data), **_gpu_check(blog_dir)}


def render(template, data, named, source="template"):
    """`template` with every placeholder replaced: `{{src:path|fmt}}` is the entry at `path` of
    results source `src`, formatted; `{{name}}` is `named[name]`. An unknown source, path or
    name is an error naming its line, so a typo can never render as text."""
    def replace(match):
        src, path, fmt = match.groups()
        where = f"{source}, line {template.count(chr(10), 0, match.start()) + 1}"
        if src == "time":  # a reading time: filled in once the whole post is rendered
            return match.group(0)
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
    return reading.fill_times(posts)


def write_posts(blog_dir):
    written = []
    for name, text in rendered_posts(blog_dir).items():
        path = os.path.join(blog_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(path)
    return written


# Prose, not code: what is left of a template once code, links, comments and placeholders go.
_INLINE_CODE = re.compile(r"`[^`\n]+`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")


def hand_typed_numbers(template, allowed=()):
    """Numbers in a template's prose that look measured: anything with a decimal point, a
    thousands separator or an exponent, or an integer of 3 or more digits, unless it is in
    `allowed` (years, arXiv numbers, the constants a writer may state). Small integers stay
    legal: section numbers, p = 2, "four collectives". Code blocks, inline code and link
    targets are not prose."""
    prose = _PLACEHOLDER.sub(" ", template)
    for pattern in (reading.FENCED, reading.COMMENT, _INLINE_CODE, _LINK_TARGET):
        prose = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    found = []
    for line_no, line in enumerate(prose.splitlines(), 1):
        for m in _NUMBER.finditer(line):
            n = m.group(0).rstrip(",")
            looks_measured = any(c in n for c in ".,e") or len(n) >= 3
            if looks_measured and n not in allowed:
                found.append((line_no, n))
    return found
