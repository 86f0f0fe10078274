"""What the tests share: backends, configs, tolerances, the error measure, and a TP model
checked against its baseline. Test files import from here (and from processes.py: the pools and
background commands), never from one another.

Worker-side functions (`_on_rank_*` in the test files) run inside the ranks of a pool (see
conftest.py) and return error measures, never verdicts; `assert_errors` runs in the pytest
process and prints the numbers. The error is max |actual - expected| / max |expected|, so one
tolerance fits tensors of any scale.

Tolerance policy (tests/README.md):
- fp32: <= 1e-5, for one layer and for the whole model along three SGD steps. TP changes only
  the order of additions.
- bf16: the TP result and the single-device bf16 result are both compared with an fp64 (layers)
  or fp32 (model) reference; TP may be at most 2x worse than single-device bf16, plus one bf16
  rounding step (2^-8).
A sharding bug gives errors of order 1 in either dtype.
"""
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensor_parallel_toy.support.sharding import full_grads, full_state_dict
from tensor_parallel_toy.config import ModelConfig
from tensor_parallel_toy.launcher.initialize import (SHARE_GPU_ENV, current_device, gpu_count,
                                                     nccl_rank_capacity)
from tensor_parallel_toy.guards import guard
from tensor_parallel_toy.model import Transformer
from tensor_parallel_toy.profiling.spec import DTYPES  # noqa: F401 (the one name -> dtype map)
from tensor_parallel_toy.support.sharding import grad_norm

FP32_TOL = 1e-5  # one layer, fp32, against fp64
MODEL_FP32_TOL = 1e-5  # whole model in fp32, along SGD steps: measured worst ~1e-6

BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=pytest.mark.skipif(
        nccl_rank_capacity() < 2,
        reason=f"NCCL tests need >= 2 CUDA GPUs (or {SHARE_GPU_ENV}=1 and one), found "
               f"{gpu_count()}")),
]

# Divisible by 1, 2, 3, 4, 6 and 12: one config serves every TP size we test.
CONFIG = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12,
                     ffn_hidden_size=96, max_seq_len=32)
SEQ, BATCH = 12, 2


def world():
    """(group, size, rank) of the whole world, inside a rank."""
    group = dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def fixed_batch(seed=7, seq=SEQ):
    """ids and labels `[BATCH, seq]` of CONFIG's vocabulary on this rank's device, the same on
    every rank."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, seq), generator=gen)
    labels = torch.randint(0, CONFIG.vocab_size, (BATCH, seq), generator=gen)
    return ids.to(current_device()), labels.to(current_device())


def max_rel_error(actual, expected):
    """max |actual - expected| / max |expected|; shapes must match exactly (no broadcasting,
    which would hide a wrong sequence length of 1)."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"shape {list(actual.shape)} != expected {list(expected.shape)}")
    diff = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().max()
    scale = expected.detach().double().abs().max().clamp_min(1e-30).cpu()
    return (diff / scale).item()


def worst_per_key(per_rank):
    """{key: largest error over the ranks} from one {key: error} dict per rank."""
    worst = {}
    for errors in per_rank:
        for key, value in errors.items():
            worst[key] = max(worst.get(key, 0.0), value)
    return worst


def assert_errors(per_rank, tol, what):
    """per_rank: one {key: error} dict per rank. Fails listing every key above `tol`."""
    worst = worst_per_key(per_rank)
    bad = {k: v for k, v in worst.items() if not v <= tol}
    assert not bad, (f"{what}: above tolerance {tol:g}: "
                     + ", ".join(f"{k}={v:.3g} (needs tol >= {v:.3g})" for k, v in bad.items()))
    return worst


BF16_EPS = 2.0 ** -8  # bf16's relative rounding step: one rounding may cost this much


def assert_bf16(per_rank, what):
    """Each rank returns {key: (tp_error, single_device_error)} against the same reference.
    TP may be at most twice as far from it as the same computation on one device in bf16, plus
    one bf16 rounding step (where the single-device error is near zero, summing in another
    order may still cost a rounding)."""
    bad = []
    for errors in per_rank:
        for key, (tp_err, base_err) in errors.items():
            allowed = 2 * base_err + BF16_EPS
            if not tp_err <= allowed:
                bad.append(f"{key}: TP bf16 error {tp_err:.3g} vs single-device bf16 "
                           f"{base_err:.3g} (allowed {allowed:.3g})")
    assert not bad, f"{what}: " + "; ".join(bad)


def assert_one_line(message, words, what):
    """An error message is the package's kind: there at all, one line, naming each of `words`
    (the bad value, what would be valid). Fails printing the message."""
    assert message is not None, f"{what}: no error raised"
    missing = [w for w in words if w not in message]
    assert "\n" not in message and not missing, (
        f"{what}: {message!r} " + (f"does not mention {missing}" if missing else
                                   "is not one line"))


def assert_usage_error(main, flags, words, capsys):
    """A command's `main(flags)` refuses them as argparse does: exit status 2 and one line on
    stderr holding `words`."""
    with pytest.raises(SystemExit) as exited:
        main(flags)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and words in err, err


def value_error_messages(cases):
    """{key: the one-line ValueError message of calling `cases[key]()`, or None if it did not
    raise}, then a barrier: every rank got past every case, so none was left in a collective.
    Inside a rank only."""
    messages = {}
    for key, fn in cases.items():
        try:
            fn()
            messages[key] = None
        except ValueError as e:
            messages[key] = str(e)
    dist.barrier()
    return messages


def import_transformers():
    """`transformers`, a pinned requirement: its absence fails the test rather than skip it."""
    try:
        import transformers
    except ImportError as e:
        pytest.fail(f"transformers cannot be imported ({e}); pip install -r requirements.txt")
    return transformers


@torch.no_grad()
def draw_norms_and_biases_(model):
    """Move a fresh Hugging Face model's norm weights (all ones) and biases (all zeros) off
    their defaults, so that a gradient routed wrongly through them shows. Returns `model`."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.1)
        elif name.endswith("bias"):
            param.normal_(0.0, 0.1)
    return model


# The sizes of the tests' tiny random Hugging Face models (nothing is downloaded).
TINY_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def tiny_hf_model(config_cls, model_cls, **change):
    """A tiny random `transformers` model, TINY_HF's sizes with `change`, in eval mode, its norm
    weights and biases drawn off their defaults; seeded: the same for the same arguments."""
    transformers = import_transformers()
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY_HF, **change})
    return draw_norms_and_biases_(getattr(transformers, model_cls)(config).eval())


def random_batch(config, batch, seq, seed, ignore_frac=0.0, ignore_index=-100):
    """ids and labels `[batch, seq]` on this rank's device, the same on every rank; a fraction
    of the labels set to ignore_index."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    labels[torch.rand(batch, seq, generator=gen) < ignore_frac] = ignore_index
    return ids.to(current_device()), labels.to(current_device())


def train_beside_baseline(config, parallel_step, parallel_params, optimizer_params, *, steps,
                          batch_of, bf16=False, label_smoothing=0.0):
    """A parallel model trained beside the baseline (one device, seed 0), both by SGD with
    momentum, checked at every step against full tensors. The one comparison loop every
    parallel model's test shares (ours, ours in 2-D, the DTensor plan).

    - `parallel_step(ids, labels, base)` runs forward and backward on the parallel model and
      returns {"loss": the whole batch's loss, "grads": {name: full gradient},
      "grad_norm": float, and optionally "logits": [b, s, V], "errors": {key: error}}; `base`
      (the fp32 baseline, its gradients of this step already there) is for checks of its own,
      returned in "errors".
    - `parallel_params()` -> {name: full parameter}; `optimizer_params`: the parallel model's
      (wrapped) parameters for its optimizer; `batch_of(step)` -> (ids, labels).
    Checked: the weights before training, then at every step logits (when given), loss, every
    gradient, the gradient norm, and every parameter after the step. Returns {key: worst
    error} and "#grads", the number of gradients compared; with `bf16` each error is a pair
    (parallel error, the error of the same model in bf16 on one device), for assert_bf16.

    The optimizer is SGD with momentum, not AdamW: AdamW's first steps divide each gradient by
    its own magnitude, so an entry near its eps (1e-8) turns fp32 round-off into parameter
    differences of 1e-3, whatever the parallelism. SGD keeps the check about parallelism: the
    steps still catch a replica or a tied weight that is updated differently.
    """
    dev = current_device()
    base = Transformer(config, seed=0).to(dev)
    bases = {"fp32": base}
    if bf16:  # the single-device bf16 run that sets the bf16 tolerance
        bases["bf16"] = Transformer(config, seed=0).to(dev, torch.bfloat16)
    sgd = lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1)  # noqa
    optimizers = [sgd(m.parameters()) for m in bases.values()] + [sgd(optimizer_params)]
    errors = {}

    def note(key, actual, expected, of_bf16=None):
        err = max_rel_error(actual, expected)
        if bf16:
            old = errors.get(key, (0.0, 0.0))
            errors[key] = (max(old[0], err), max(old[1], max_rel_error(of_bf16, expected)))
        else:
            errors[key] = max(errors.get(key, 0.0), err)

    def note_params(prefix):
        params16 = dict(bases["bf16"].named_parameters()) if bf16 else {}
        full = parallel_params()
        for name, p in base.named_parameters():
            note(prefix + name, full[name], p, params16.get(name))

    note_params("init:")
    for step in range(steps):
        ids, labels = batch_of(step)
        logits, losses = {}, {}
        for kind, m in bases.items():
            logits[kind] = m(ids)
            losses[kind] = F.cross_entropy(logits[kind].flatten(0, 1).float(), labels.flatten(),
                                           label_smoothing=label_smoothing)
            losses[kind].backward()
        got = parallel_step(ids, labels, base)
        if "logits" in got:
            note("logits", got["logits"], logits["fp32"], logits.get("bf16"))
        note("loss", got["loss"], losses["fp32"], losses.get("bf16"))
        errors["#grads"] = len(got["grads"])
        grads16 = {n: p.grad for n, p in bases["bf16"].named_parameters()} if bf16 else {}
        for name, p in base.named_parameters():
            note("grad:" + name, got["grads"][name], p.grad, grads16.get(name))
        norms = {k: torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
                 for k, m in bases.items()}
        note("grad_norm", torch.tensor(got["grad_norm"]), norms["fp32"], norms.get("bf16"))
        for key, value in got.get("errors", {}).items():
            errors[key] = max(errors.get(key, 0.0), value)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        note_params("param:")
    return errors


def compare_with_baseline(config, tp_group, *, overlap=False, ring_pieces=1, steps=2, batch=2,
                          seq=12, ignore_frac=0.25, label_smoothing=0.0, model_cls=Transformer,
                          sequence_parallel=True):
    """Our TP model (same seed as the baseline), guarded as users guard it, trained beside it:
    train_beside_baseline, the TP loss through the model's vocab-parallel cross-entropy,
    ignored labels included. `model_cls`: Transformer or a subclass (TransformerInHalves)."""
    options = {"overlap": overlap, "ring_pieces": ring_pieces} if overlap else {}
    if not sequence_parallel:  # classic TP: the same layers, switched
        options["sequence_parallel"] = False
    tp = guard(model_cls(config, tp_group=tp_group, seed=0, **options).to(current_device()))

    def step(ids, labels, base):
        logits = tp(ids)
        loss = tp(ids, labels, label_smoothing=label_smoothing)
        loss.backward()
        return {"logits": logits, "loss": loss, "grads": full_grads(tp),
                "grad_norm": grad_norm(tp, tp_group)}

    def batch_of(step):
        return random_batch(config, batch, seq, seed=step, ignore_frac=ignore_frac)

    return train_beside_baseline(config, step, lambda: full_state_dict(tp), tp.parameters(),
                                 steps=steps, batch_of=batch_of, label_smoothing=label_smoothing)


_MESHES = {}  # per rank process: creating a mesh's groups is collective, and they are never freed


def mesh_2x2():
    """The ("dp", "tp") = 2 x 2 DeviceMesh of a 4-rank pool, made on first use inside a rank:
    every test on the shared pool reuses it."""
    from tensor_parallel_toy.interop.data_parallel import init_mesh_2d

    if "2x2" not in _MESHES:
        _MESHES["2x2"] = init_mesh_2d(dp_size=2, tp_size=2)
    return _MESHES["2x2"]


def compare_on_world(config, **kwargs):
    """compare_with_baseline with TP over all ranks (a pool's `run` target: the WORLD group
    exists only inside the ranks)."""
    return compare_with_baseline(config, dist.group.WORLD, **kwargs)


def assert_matches_baseline(per_rank, config, what, tol=MODEL_FP32_TOL):
    """Every rank within `tol`, and every baseline parameter's gradient was compared."""
    n_params = len(dict(Transformer(config).named_parameters()))
    counts = {errors.pop("#grads") for errors in per_rank}
    assert counts == {n_params}, f"{what}: compared {counts} gradients, the model has {n_params}"
    return assert_errors(per_rank, tol, what)


# ----------------------------------------------------------------------------------------------
# Code quoted in Markdown (the posts, the README): an excerpt tag, then a fenced block that must
# appear in the tagged file character for character (see test_blog.py's docstring)
# ----------------------------------------------------------------------------------------------
_TAG = re.compile(r"<!--\s*excerpt:\s*(\S+)\s*-->")
_FENCE = re.compile(r"^(`{3,}|~{3,})")


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
