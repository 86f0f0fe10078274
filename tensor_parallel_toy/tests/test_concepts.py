"""The activation-memory model against what autograd actually saves, and the blog's conceptual
figures: present, drawn from the current source, and drawn the same way every time.

The memory model is checked tensor by tensor: every storage it lists must be one autograd
keeps (matched by size, at the profile's default shape), and what autograd keeps beyond them
(token ids, labels, rotary tables, masks) must stay under 0.2 % of the total. Three models:
the single-device baseline, the TP + SP model at p = 2, and the baseline with its blocks split
by `classic_tp.apply_tensor_parallel` (TP without SP) at p = 2.
"""
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tensor_parallel_toy.config import ModelConfig
from tensor_parallel_toy.model import Transformer
from tensor_parallel_toy.post import concepts
from tensor_parallel_toy.profiling.measure.memory_model import (
    bf16_extra_bytes, block_saved_elements, model_saved_bytes, model_saved_elements, profile_shape)
from tensor_parallel_toy.rotary import rotate
from tensor_parallel_toy.profiling.measure.metrics import SavedActivationBytes
from tensor_parallel_toy.profiling.spec import MODEL_DEFAULTS, SEQ
from tensor_parallel_toy.profiling.run.tp_no_sp import classic_tp_model

from .helpers import max_rel_error

CONFIG = ModelConfig(**MODEL_DEFAULTS, max_seq_len=SEQ)  # the profile's default model
SHAPE = profile_shape()  # s, b, h, f, a, p
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURES = os.path.join(ROOT, "blog", "figures")
EXTRA_TOL = 0.002  # what autograd keeps beyond the model's list, as a fraction of the list


def _batch():
    gen = torch.Generator().manual_seed(0)
    size = (SHAPE["b"], SHAPE["s"])
    return (torch.randint(0, CONFIG.vocab_size, size, generator=gen),
            torch.randint(0, CONFIG.vocab_size, size, generator=gen))


def _saved_storages(model):
    """(loss, bytes of each storage autograd saved during one forward + backward)."""
    ids, labels = _batch()
    with SavedActivationBytes(model) as meter:
        loss = model.loss(ids, labels)
        loss.backward()
    return loss.detach(), meter.storage_bytes


def _on_rank_tp_sp():
    return _saved_storages(Transformer(CONFIG, tp_group=dist.group.WORLD))[1]


def _on_rank_classic_tp():
    """The baseline Transformer with every block split by apply_tensor_parallel; its loss must
    be the unsplit model's, or the bytes would describe a wrong model."""
    model = Transformer(CONFIG)
    expected = model.loss(*_batch()).detach()
    classic_tp_model(model, dist.group.WORLD)  # the profile's conversion, as tp_no_sp measures it
    loss, storages = _saved_storages(model)
    return max_rel_error(loss, expected), storages


def _assert_matches(storages, rows, what):
    """Every tensor the model lists is a storage autograd saved; the rest is small."""
    listed = Counter(4 * n for _, _, n in rows)  # fp32
    measured = Counter(storages)
    missing, extra = listed - measured, measured - listed
    formula, total = 4 * sum(n for _, _, n in rows), sum(storages)
    extra_bytes = sum(size * count for size, count in extra.items())
    assert not missing, (f"{what}: the model lists tensors autograd did not save (bytes: "
                         f"count): {dict(missing)}; saved beyond the list: {dict(extra)}")
    assert extra_bytes <= EXTRA_TOL * formula, (
        f"{what}: formula {formula:,} B, measured {total:,} B: {extra_bytes:,} B saved beyond "
        f"the model's list ({extra_bytes / formula:.3%} > {EXTRA_TOL:.1%}): {dict(extra)}")
    print(f"{what}: formula {formula:,} B, measured {total:,} B "
          f"(+{(total - formula) / formula:.3%})")


def test_memory_model_matches_saved_tensors_single_device():
    _, storages = _saved_storages(Transformer(CONFIG))
    rows = model_saved_elements(CONFIG, SHAPE["s"], SHAPE["b"], 1)
    _assert_matches(storages, rows, "baseline")


def test_memory_model_matches_saved_tensors_tp_sp(pools):
    rows = model_saved_elements(CONFIG, SHAPE["s"], SHAPE["b"], 2)
    for rank, storages in enumerate(pools(2).run(_on_rank_tp_sp)):
        _assert_matches(storages, rows, f"TP + SP, p=2, rank {rank}")


def test_memory_model_matches_saved_tensors_classic_tp(pools):
    rows = model_saved_elements(CONFIG, SHAPE["s"], SHAPE["b"], 2, sequence_parallel=False)
    for rank, (loss_err, storages) in enumerate(pools(2).run(_on_rank_classic_tp)):
        assert loss_err <= 1e-5, f"rank {rank}: classic TP loss differs by {loss_err:.3g}"
        _assert_matches(storages, rows, f"TP alone, p=2, rank {rank}")


def test_bf16_saves_the_count_plus_the_norms_fp32_copies_and_the_fp32_softmax():
    """In bf16 the excess over the count at 2 bytes per element is what `bf16_extra_bytes`
    lists (the norms' two fp32 copies of their input and fp32 rms, the loss's fp32 softmax),
    and nothing from the rotary embedding."""
    model = Transformer(CONFIG).to(torch.bfloat16)
    _, storages = _saved_storages(model)
    formula = model_saved_bytes(CONFIG, SHAPE["s"], SHAPE["b"], 1, bytes_per_element=2)
    expected = formula + bf16_extra_bytes(CONFIG, SHAPE["s"], SHAPE["b"])
    measured = sum(storages)
    assert expected <= measured <= (1 + EXTRA_TOL) * expected, (
        f"bf16 baseline saved {measured:,} B; count at 2 B/element {formula:,} B, plus the fp32 "
        f"copies {expected:,} B (allowed beyond it: {EXTRA_TOL:.1%})")


def test_rotary_embedding_saves_only_its_tables_not_fp32_copies_of_q():
    s, b, heads, hd = 16, 2, 4, 8
    q = torch.randn(s, b, heads, hd, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(s, hd // 2), torch.randn(s, hd // 2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rotate(q, cos[:, None, None], sin[:, None, None]).sum().backward()
    sizes = {(t.dtype, t.numel()) for t in saved}
    assert all(numel <= cos.numel() for _, numel in sizes), (
        f"the rotation saved tensors larger than its [s, hd/2] tables (q has {q.numel()} "
        f"elements): {sorted(sizes, key=str)}")


ODD = ModelConfig(vocab_size=96, hidden_size=48, num_layers=3, num_heads=12, ffn_hidden_size=72,
                  max_seq_len=64)


@pytest.mark.parametrize("config, s, b, p", [(CONFIG, 128, 8, 1), (CONFIG, 128, 8, 2),
                                             (CONFIG, 128, 8, 4), (ODD, 36, 3, 3)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_per_tensor_rows_add_up_to_the_blog_formulas(config, s, b, p, sequence_parallel):
    h, f, a = config.hidden_size, config.ffn_hidden_size, config.num_heads
    L, V = config.num_layers, config.vocab_size
    block = sum(n for _, _, n in block_saved_elements(s, b, h, f, a, p, sequence_parallel))
    if sequence_parallel:  # M_TP+SP = (6sbh + 6sbh + 2sbf + sba + 2sb) / p
        formula = (6 * s * b * h + 6 * s * b * h + 2 * s * b * f + s * b * a + 2 * s * b) // p
        rest = (3 * s * b * h + s * b + s * b * V) // p
    else:  # M_TP = 6sbh + 2sb + (6sbh + 2sbf + sba) / p; the blocks alone are split
        formula = 6 * s * b * h + 2 * s * b + (6 * s * b * h + 2 * s * b * f + s * b * a) // p
        rest = 3 * s * b * h + s * b + s * b * V
    assert block == formula, (block, formula)
    total = model_saved_bytes(config, s, b, p, sequence_parallel, bytes_per_element=2)
    assert total == 2 * (L * formula + rest), (total, 2 * (L * formula + rest))


@pytest.mark.parametrize("bad, message", [
    (dict(p=3), "h=256 is not divisible by p=3"),
    (dict(s=100, p=8), "s=100 is not divisible by p=8"),
    (dict(b=0), "b=0 must be a positive integer"),
])
def test_memory_model_refuses_sizes_that_do_not_split(bad, message):
    sizes = {"s": 128, "b": 8, "h": 256, "f": 1024, "a": 8, "p": 2} | bad
    with pytest.raises(ValueError, match=message):
        block_saved_elements(**sizes)


# -- the conceptual figures --------------------------------------------------------------------------
def test_blog_figures_are_drawn_from_the_current_source():
    stale = concepts.stale_figures(FIGURES)
    assert not stale, ("blog/figures is out of date; redraw it with `python -m "
                       "tensor_parallel_toy.post.concepts blog/figures`:\n"
                       + "\n".join(stale))


def test_stale_figures_names_missing_foreign_and_unreadable_files(tmp_path):
    names = list(concepts.DRAWERS)
    assert len(concepts.stale_figures(tmp_path)) == len(names)  # all missing
    current, foreign, broken = names[-1], names[0], names[1]
    concepts.DRAWERS[current](str(tmp_path / current))
    with open(tmp_path / foreign, "wb") as f:  # a real PNG, drawn from some other source
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(1, 1))
        fig.savefig(f, format="png", metadata={concepts.SOURCE_KEY: "0" * 64})
        plt.close(fig)
    (tmp_path / broken).write_bytes(b"not a png")
    stale = {line.split(":")[0]: line for line in concepts.stale_figures(tmp_path)}
    assert current not in stale, stale[current]
    assert "0" * 64 in stale[foreign], stale[foreign]
    assert "drawn from source None" in stale[broken], stale[broken]
    assert set(stale) == set(names) - {current}, sorted(stale)


def test_drawing_a_figure_twice_gives_the_same_bytes(tmp_path):
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    concepts.draw_regions(str(first))
    concepts.draw_regions(str(second))
    assert first.read_bytes() == second.read_bytes(), "two drawings of regions.png differ"
    assert concepts.drawn_from(first) == concepts.source_hash()


def test_the_ring_run_on_a_clock_gives_part_2s_bounds_2_and_3():
    """`piece_schedule` (the figure of bounds 2 and 3) runs `ring_all_gather`'s loop on a
    clock: whole chunks end at bound 2's `(p−1)·max(τg/p, τc/(p−1)) + τg/p`, M pieces at
    `max(τg, τc + τg/(pM))`, for every p, M and ratio tried; a piece's GEMM never starts before
    it has arrived, and neither the link nor the compute runs two things at once."""
    from tensor_parallel_toy.post.concepts_rings import piece_schedule

    tau_g = 1.0
    for p in (2, 3, 8):
        for pieces in (1, 2, 4):
            for tau_c in (0.1, 0.5, (p - 1) / p, 0.9, 1.0, 1.7):
                spans, end = piece_schedule(p, pieces, tau_c, tau_g)
                if pieces == 1:
                    assert end == pytest.approx(
                        (p - 1) * max(tau_g / p, tau_c / (p - 1)) + tau_g / p)
                assert end == pytest.approx(max(tau_g, tau_c + tau_g / (p * pieces)))
                arrived = {(k, j): stop for lane, _, stop, k, j in spans if lane == "transfer"}
                for lane in ("transfer", "GEMM"):
                    runs = sorted((start, stop) for lane_, start, stop, *_ in spans
                                  if lane_ == lane)
                    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(runs, runs[1:])), runs
                assert all(start >= arrived[k, j] - 1e-12 for lane, start, _, k, j in spans
                           if lane == "GEMM" and k > 0)
                assert len(arrived) == (p - 1) * pieces
