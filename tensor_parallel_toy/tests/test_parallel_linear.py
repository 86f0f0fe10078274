"""The column and row layers, basic and overlapped, against F.linear on full tensors: every
output and gradient, in fp32 and bf16, strided inputs, subgroups, multi-MB ring steps, and the
standalone layers' initialisation.

Functions named `_on_rank_*` run inside the worker ranks (see conftest.py) and return error
measures, never verdicts: the assertions run here in the pytest process and print the numbers.
The tolerance policy is in helpers.py (and tests/README.md).
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tensor_parallel_toy import (ColumnParallelLinear, RowParallelLinear, column_parallel_linear, guard,
                                 row_parallel_linear)
from tensor_parallel_toy.launcher.initialize import current_device

from .helpers import (BACKENDS, BATCH, DTYPES, FP32_TOL, SEQ, assert_bf16, assert_errors,
                      assert_one_line, max_rel_error, value_error_messages, world)


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------
def _linear_case(in_f, out_f, dtype, bias, seed=1234):
    """Full X, W, b, dY (values exactly representable in `dtype`) and the fp64 reference."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, in_f, generator=gen).to(dtype)
    w = (torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)).to(dtype)
    b = torch.randn(out_f, generator=gen).to(dtype)
    dy = torch.randn(SEQ, BATCH, out_f, generator=gen).to(dtype)
    ref = {k: t.double().requires_grad_() for k, t in (("x", x), ("w", w), ("b", b))}
    y = F.linear(ref["x"], ref["w"], ref["b"] if bias else None)
    y.backward(dy.double())
    return (x, w, b, dy), {"y": y.detach(), "dx": ref["x"].grad, "dw": ref["w"].grad,
                           "db": ref["b"].grad}


def _batch_first_view(t):
    """The same values as `t` [s, b, ...], laid out batch-first: a leaf [b, s, ...] and its
    transposed (non-contiguous) [s, b, ...] view, as a batch-first model would pass it."""
    leaf = t.detach().transpose(0, 1).contiguous().requires_grad_(t.requires_grad)
    return leaf, leaf.transpose(0, 1)


def _forward_backward(layer, x, dy, strided):
    """y = layer(x), then backward from dy; returns (y, dx), dx laid out as x [s, b, ...].
    `strided`: x and dy are passed as transposed views of batch-first tensors."""
    x_leaf = x_in = x.requires_grad_()
    if strided:
        x_leaf, x_in = _batch_first_view(x_leaf)
        dy = _batch_first_view(dy)[1]
        assert not x_in.is_contiguous() and not dy.is_contiguous()
    y = layer(x_in)
    y.backward(dy)
    return y, x_leaf.grad.transpose(0, 1) if strided else x_leaf.grad


# overlap="pieces": the ring with each chunk cut into this many pieces, by TP size (SEQ = 12
# rows: 6, 4 or 3 per rank).
PIECES = {2: 3, 3: 2, 4: 3}


def _run_parallel_linear(kind, overlap, bias, dtype, full, group, strided=False):
    """Run one TP layer on this rank's shards of the full tensors; return full-shape-indexed
    views of the reference that this rank's results must equal, and those results.
    `strided`: the input and the output gradient are transposed views of batch-first tensors."""
    x, w, b, dy = full
    p, r, dev = dist.get_world_size(group), dist.get_rank(group), current_device()
    pieces = PIECES[p] if overlap == "pieces" else 1
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(w.shape[1], w.shape[0], tp_group=group, bias=bias, overlap=bool(overlap),
                ring_pieces=pieces, device=dev, dtype=dtype)
    seq = lambda t: t.chunk(p, dim=0)[r]  # noqa: E731  this rank's sequence rows
    feat = lambda t, d=-1: t.chunk(p, dim=d)[r]  # noqa: E731  this rank's feature slice
    with torch.no_grad():
        layer.weight.copy_(feat(w, 0) if kind == "column" else feat(w, 1))
        if bias:
            layer.bias.copy_(feat(b, 0) if kind == "column" else b)
    y, dx = _forward_backward(layer, (seq(x) if kind == "column" else feat(x)).to(dev),
                              (feat(dy) if kind == "column" else seq(dy)).to(dev), strided)
    got = {"y": y, "dx": dx, "dw": layer.weight.grad}
    if bias:
        got["db"] = layer.bias.grad
    if kind == "column":
        want = {"y": lambda t: feat(t), "dx": seq, "dw": lambda t: feat(t, 0),
                "db": lambda t: feat(t, 0)}
    else:
        want = {"y": seq, "dx": lambda t: feat(t), "dw": lambda t: feat(t, 1), "db": lambda t: t}
    return got, want


def _on_rank_check_linear(kind, overlap, bias, dtype_name):
    group, _, _ = world()
    dtype = DTYPES[dtype_name]
    in_f, out_f = 24, 36
    full, ref = _linear_case(in_f, out_f, dtype, bias)
    got, want = _run_parallel_linear(kind, overlap, bias, dtype, full, group)
    if dtype == torch.float32:
        return {k: max_rel_error(v, want[k](ref[k])) for k, v in got.items()}
    # bf16: the same computation on one device in bf16, against the same fp64 reference.
    x, w, b, dy = (t.clone() for t in full)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = F.linear(x, w, b if bias else None)
    y.backward(dy)
    single = {"y": y, "dx": x.grad, "dw": w.grad, "db": b.grad}
    return {k: (max_rel_error(v, want[k](ref[k])),
                max_rel_error(want[k](single[k]), want[k](ref[k]))) for k, v in got.items()}


def _on_rank_check_linear_strided(kind, overlap, bias):
    group, _, _ = world()
    full, ref = _linear_case(24, 36, torch.float32, bias)
    got, want = _run_parallel_linear(kind, overlap, bias, torch.float32, full, group,
                                     strided=True)
    return {k: max_rel_error(v, want[k](ref[k])) for k, v in got.items()}


def _on_rank_bf16_weight_grad_error(kind):
    """The weight gradient's error against fp64, bf16 layers, basic vs overlapped (the
    overlapped one sums p chunk products: in fp32, it must lose nothing to the basic one)."""
    group, _, _ = world()
    full, ref = _linear_case(96, 64, torch.bfloat16, bias=False)
    errors = {}
    for overlap in (False, True):
        got, want = _run_parallel_linear(kind, overlap, False, torch.bfloat16, full, group)
        errors[overlap] = max_rel_error(got["dw"], want["dw"](ref["dw"]))
    return errors


def _on_rank_check_linear_on_subgroups(groups):
    """Layers on TP subgroups of WORLD; ring neighbours must be translated to global ranks."""
    mine, subgroups = dist.new_subgroups_by_enumeration(groups)
    errors = {}
    for kind in ("column", "row"):
        for overlap in (False, True):
            full, ref = _linear_case(24, 36, torch.float32, bias=True)
            got, want = _run_parallel_linear(kind, overlap, True, torch.float32, full, mine)
            for k, v in got.items():
                errors[f"{kind}/overlap={overlap}/{k}"] = max_rel_error(v, want[k](ref[k]))
    for g in subgroups:
        dist.destroy_process_group(g)
    return errors


# ----------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("overlap", [False, True, "pieces"], ids=["basic", "overlap", "pieces"])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_parallel_linear_matches_full_linear(pools, tp, kind, overlap, bias, dtype, backend):
    per_rank = pools(tp, backend).run(_on_rank_check_linear, kind, overlap, bias, dtype)
    what = f"{kind} tp={tp} overlap={overlap} bias={bias} {dtype}"
    if dtype == "fp32":
        assert_errors(per_rank, FP32_TOL, what)
    else:
        assert_bf16(per_rank, what)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("overlap", [False, True, "pieces"], ids=["basic", "overlap", "pieces"])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", [2, 3])
def test_parallel_linear_takes_transposed_views_of_batch_first_tensors(pools, tp, kind, overlap,
                                                                      bias, backend):
    per_rank = pools(tp, backend).run(_on_rank_check_linear_strided, kind, overlap, bias)
    assert_errors(per_rank, FP32_TOL, f"strided {kind} tp={tp} overlap={overlap} bias={bias}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", [2, 4])
def test_overlapped_bf16_weight_grad_is_as_accurate_as_basic(pools, tp, kind, backend):
    # On CUDA the overlapped sum runs bf16 GEMMs with fp32 output, on CPU upcast fp32 GEMMs
    # (ring.WeightGradAccumulator): both must match the basic layer's accuracy.
    for rank, errors in enumerate(pools(tp, backend).run(_on_rank_bf16_weight_grad_error, kind)):
        basic, overlapped = errors[False], errors[True]
        # Both round one fp32 sum to bf16 once; the sums differ only in fp32 round-off.
        assert overlapped <= basic * 1.01, (
            f"{kind} tp={tp} rank {rank}: overlapped bf16 dW error {overlapped:.3g} vs basic "
            f"{basic:.3g} (allowed {basic * 1.01:.3g})")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [[[0, 2], [1, 3]], [[0, 1], [2, 3]]], ids=["strided", "blocks"])
def test_parallel_linear_on_tp_subgroups(pools, groups, backend):
    assert_errors(pools(4, backend).run(_on_rank_check_linear_on_subgroups, groups), FP32_TOL,
                   f"subgroups {groups}")


def _on_rank_check_multi_megabyte_rings():
    """Column and row layers, overlapped, with ring steps of 2 MiB (s=1024, b=1, 1024 features,
    fp32, p=2): a transfer long enough that a missing or misplaced wait would show as stale
    data on a GPU, where tiny transfers finish before anyone could read them early. Compared
    with the same layers on one device, in fp32."""
    group, _, _ = world()
    gen = torch.Generator().manual_seed(5)
    s, b, h = 1024, 1, 1024
    full = (torch.randn(s, b, h, generator=gen), torch.randn(h, h, generator=gen) / 32,
            torch.randn(h, generator=gen), torch.randn(s, b, h, generator=gen))
    x, w, bias = (t.clone().requires_grad_() for t in full[:3])
    dy = full[3]
    y = F.linear(x, w, bias)
    y.backward(dy)
    ref = {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": bias.grad}
    errors = {}
    for kind in ("column", "row"):
        got, want = _run_parallel_linear(kind, True, True, torch.float32, full, group)
        errors.update({f"{kind}/{k}": max_rel_error(v, want[k](ref[k])) for k, v in got.items()})
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapped_layers_are_exact_with_multi_megabyte_ring_steps(pools, backend):
    assert_errors(pools(2, backend).run(_on_rank_check_multi_megabyte_rings), FP32_TOL,
                  "2 MiB ring steps")


def _on_rank_standalone_init(seed):
    """Standalone layers built after the same seed on every rank: their shards, gathered, must
    be the weight the unsplit PyTorch layer draws after that seed, and the generator must stay
    in step across ranks."""
    from tensor_parallel_toy import VocabParallelEmbedding
    from tensor_parallel_toy.parallel_linear import layout_of
    from tensor_parallel_toy.support.sharding import unshard

    group, _, _ = world()
    cases = {"column": (lambda: ColumnParallelLinear(24, 36, tp_group=group),
                        lambda: nn.Linear(24, 36, bias=False)),
             "row": (lambda: RowParallelLinear(24, 36, tp_group=group),
                     lambda: nn.Linear(24, 36, bias=False)),
             "embedding": (lambda: VocabParallelEmbedding(24, 6, tp_group=group),
                           lambda: nn.Embedding(24, 6))}
    errors = {}
    for name, (build_parallel, build_plain) in cases.items():
        torch.manual_seed(seed)
        layer = build_parallel()
        after = torch.rand(8)  # the generator's state after the build, compared across ranks
        torch.manual_seed(seed)
        plain = build_plain()
        errors[name] = max_rel_error(unshard(layer.weight.detach(), layout_of(layer, "weight"),
                                             group),
                                     plain.weight)
        gathered = [torch.empty_like(after) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, after, group=group)
        errors[name + ": generator out of step"] = max(max_rel_error(g, after) for g in gathered)
    return errors


@pytest.mark.parametrize("tp", [2, 3])
def test_standalone_layers_are_shards_of_one_layer_initialised_like_pytorch(pools, tp):
    # nn.Linear's bound comes from kaiming_uniform_'s gain formula: equal up to float round-off.
    assert_errors(pools(tp).run(_on_rank_standalone_init, 11), 1e-6, f"standalone init tp={tp}")


def _on_rank_check_shaped_column(out_shape, split_dim, kv, dtype_name, strided):
    """A ColumnParallelLinear with an output shape, or with attention's q/k/v rows
    (`kv`: `model.qkv_rows`, out_shape = (kv heads, q heads per kv head + 2, head size)),
    against F.linear with the full weight: output, input gradient, weight and bias gradients,
    at this rank's rows of each (`RowSplit.rows`). Rows that several ranks hold (shared k/v)
    stand for one output used by all of them: each rank gets a different share of that
    output's gradient, the shares summing to it, and each must end with the full weight
    gradient of those rows."""
    from tensor_parallel_toy.model import qkv_rows
    from tensor_parallel_toy.parallel_linear import layout_of

    group, p, r = world()
    dtype, dev = DTYPES[dtype_name], current_device()
    x, w, b, dy = _linear_case(24, math.prod(out_shape), dtype, bias=True)[0]
    if kv:
        nkv, q_per_kv, hd = out_shape[0], out_shape[1] - 2, out_shape[2]
        layer = ColumnParallelLinear(24, math.prod(out_shape), tp_group=group, bias=True,
                                     rows=qkv_rows(nkv, q_per_kv, hd, p), device=dev,
                                     dtype=dtype)
    else:
        layer = ColumnParallelLinear(24, out_shape, tp_group=group, bias=True,
                                     split_dim=split_dim, device=dev, dtype=dtype)
    every = layout_of(layer, "weight").rows.rows  # [p, rows]
    rows = every[r]
    share = torch.ones(len(rows), dtype=dtype)  # this rank's share of each row's gradient
    for i, row in enumerate(rows.tolist()):  # holder j of c: (j + 1) / (1 + 2 + ... + c)
        holders = torch.nonzero((every == row).any(dim=1)).flatten().tolist()
        c = len(holders)
        share[i] = (holders.index(r) + 1) / (c * (c + 1) / 2)
    with torch.no_grad():
        layer.weight.copy_(w[rows]), layer.bias.copy_(b[rows])
    y, dx = _forward_backward(layer, x.chunk(p)[r].to(dev),
                              (dy[..., rows].float() * share).to(dev, dtype), strided)
    got = {"y": y, "dx": dx, "dw": layer.weight.grad, "db": layer.bias.grad}
    want = {"y": lambda t: t[..., rows], "dx": lambda t: t.chunk(p)[r],
            "dw": lambda t: t[rows], "db": lambda t: t[rows]}

    def plain(t_dtype):
        leaves = [t.to(t_dtype).requires_grad_() for t in (x, w, b)]
        out = F.linear(*leaves)
        out.backward(dy.to(t_dtype))
        return {"y": out, "dx": leaves[0].grad, "dw": leaves[1].grad, "db": leaves[2].grad}

    ref = plain(torch.float64)
    if dtype == torch.float32:
        return {k: max_rel_error(v, want[k](ref[k])) for k, v in got.items()}
    single = plain(dtype)  # the same layer on one device in bf16: the error to compare with
    return {k: (max_rel_error(v, want[k](ref[k])), max_rel_error(want[k](single[k]),
                                                                 want[k](ref[k])))
            for k, v in got.items()}


# (output shape, split dim, attention's q/k/v rows): gate/up (2, f) split along f; q, k, v of 4
# k/v heads with 3 query heads each, split along the k/v heads; MQA's one k/v head with 4
# query heads, its k and v shared by every rank.
SHAPED = {"gate-up": ((2, 12), 1, False), "gqa": ((4, 5, 3), 0, True),
          "mqa": ((1, 6, 3), 0, True)}


@pytest.mark.parametrize("case", ["fp32-strided", "bf16"])
@pytest.mark.parametrize("layout", list(SHAPED))
@pytest.mark.parametrize("tp", [2, 4])
def test_column_layer_with_an_output_shape_matches_full_linear(pools, tp, layout, case):
    dtype, strided = case.split("-")[0], case.endswith("strided")
    per_rank = pools(tp).run(_on_rank_check_shaped_column, *SHAPED[layout], dtype, strided)
    what = f"column {SHAPED[layout]} tp={tp} {case}"
    if dtype == "fp32":
        assert_errors(per_rank, FP32_TOL, what)
    else:
        assert_bf16(per_rank, what)


def _on_rank_shapes_two_ranks_cannot_split():
    group, rank = dist.group.WORLD, dist.get_rank()
    cases = {shape: (lambda shape=shape: ColumnParallelLinear(8, shape, tp_group=group))
             for shape in ((3, 4, 2), (1, 5, 2), (1, 4, 2))}
    cases["int"] = lambda: ColumnParallelLinear(8, 12, tp_group=group, split_dim=1)
    # Both ranks get a [12, 8] shard, of different rows: only the fingerprint can tell.
    cases["split_dim"] = lambda: guard(ColumnParallelLinear(8, (2, 12), tp_group=group,
                                                            split_dim=rank))
    return value_error_messages(cases)


def test_output_shapes_the_ranks_cannot_split_raise_one_clear_error(pools):
    """3, then 1 along dim 0 over 2 ranks (shapes of q/k/v rows: the config refuses k/v heads
    that neither divide nor are divided by the TP size before any layer exists); a split_dim
    without a shape; ranks splitting the same shape along different dims (same local shape),
    refused on every rank when guarded."""
    per_rank = pools(2).run(_on_rank_shapes_two_ranks_cannot_split)
    for shape, message in per_rank[0].items():
        if shape == "int":
            assert_one_line(message, ["split_dim=1", "out_features=12", "tuple"], "int + split")
        elif shape == "split_dim":
            for rank_messages in per_rank:
                assert_one_line(rank_messages["split_dim"], ["split"], "split_dim per rank")
        else:
            assert_one_line(message, [f"out_features={shape}", "tensor-parallel size 2"],
                            f"out_features={shape}")


def _on_rank_uneven_pieces():
    """6 sequence rows per rank cut into 4 ring pieces, and bad overlap options: refused."""
    group = dist.group.WORLD
    x = torch.randn(6, 2, 8)
    return value_error_messages({
        "column": lambda: ColumnParallelLinear(8, 4, tp_group=group, overlap=True,
                                               ring_pieces=4)(x),
        "row": lambda: RowParallelLinear(8, 4, tp_group=group, overlap=True, ring_pieces=4)(
            torch.randn(12, 2, 4)),
        "number": lambda: guard(ColumnParallelLinear(8, 4, tp_group=group, overlap=4)),
        "zero": lambda: guard(ColumnParallelLinear(8, 4, tp_group=group, overlap=True,
                                                   ring_pieces=0))})


def test_ring_pieces_that_do_not_divide_the_rows_are_refused_in_one_line_on_every_rank(pools):
    for rank, messages in enumerate(pools(2).run(_on_rank_uneven_pieces)):
        for kind in ("column", "row"):
            assert_one_line(messages[kind], ["6 sequence rows per rank", "4 ring pieces"],
                            f"rank {rank} {kind}")
        assert_one_line(messages["number"], ["overlap=4", "False", "True", "ring_pieces="],
                        f"rank {rank} overlap=4")
        assert_one_line(messages["zero"], ["ring_pieces=0", "m >= 1"], f"rank {rank} pieces 0")


def test_functional_ops_on_a_group_of_one_are_plain_linear():
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((5, 2, 8), (6, 8), (6,)))
    for op in (column_parallel_linear, row_parallel_linear):
        for overlap in (False, True):
            got = op(x, w, b, None, overlap=overlap)
            assert torch.equal(got, F.linear(x, w, b)), (op.__name__, overlap)
