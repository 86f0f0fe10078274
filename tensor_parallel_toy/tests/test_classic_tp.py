"""`apply_tensor_parallel` on models of the user's own: an MLP block on `[B, T, C]` tokens and a
1x1-conv block on `[B, C, H, W]` images, against the same model unsharded, every gradient; the
plan it carries out (`classic_plan`) against one written by hand, and edited for a fused conv."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tensor_parallel_toy.apply import ColwiseParallel, NoParallel, RowwiseParallel
from tensor_parallel_toy.apply.classic_tp import (apply_tensor_parallel, classic_plan,
                                                  sync_replicated_gradients)
from tensor_parallel_toy.apply.layers import PlannedColumn, PlannedRow
from tensor_parallel_toy.comm import all_gather_dim
from tensor_parallel_toy.support.sharding import layouts

from .helpers import FP32_TOL, assert_errors, assert_one_line, max_rel_error


class FeedForward(nn.Module):
    """A user's block: the layers to split live inside a Sequential, hence dotted paths."""
    tp_column = "net.0"
    tp_row = "net.2"

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        return x + self.net(self.norm(x))


class GatedFeedForward(nn.Module):
    """Two column layers (gate and up) feeding one row layer, without biases, and a weight of
    the block's own beside them (kept whole). Declared with the older attribute names, which
    stay accepted."""
    _tp_col = ("gate", "up")
    _tp_row = "down"

    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x + self.scale * self.down(F.silu(self.gate(x)) * self.up(x))


class ConvMixer(nn.Module):
    """A vision/weather-style channel MLP made of 1x1 convolutions."""
    tp_column = "expand"
    tp_row = "project"

    def __init__(self, channels, hidden):
        super().__init__()
        self.norm = nn.GroupNorm(1, channels)
        self.expand = nn.Conv2d(channels, hidden, kernel_size=1)
        self.project = nn.Conv2d(hidden, channels, kernel_size=1)

    def forward(self, x):
        return x + self.project(F.gelu(self.expand(self.norm(x))))


class GatedConvMixer(nn.Module):
    """One fused 1x1 conv producing the gate and up channels `[B, 2*hidden, H, W]`, then a 1x1
    projection: as plain rows rank 0 would hold gate channels only."""
    tp_column, tp_row = "expand", "project"

    def __init__(self, channels, hidden):
        super().__init__()
        self.expand = nn.Conv2d(channels, 2 * hidden, kernel_size=1)
        self.project = nn.Conv2d(hidden, channels, kernel_size=1)

    def forward(self, x):
        gate, up = self.expand(x).chunk(2, dim=1)  # [B, hidden/p, H, W] each on a rank
        return x + self.project(F.silu(gate) * up)


def _mlp_model():
    return nn.Sequential(nn.Linear(5, 8), FeedForward(8, 16), GatedFeedForward(8, 12),
                         nn.Linear(8, 3)), torch.randn(4, 6, 5)  # x [B, T, C]


def _conv_model():
    # The 3x3 stem declares nothing, so it stays whole (replicated) on every rank.
    return nn.Sequential(nn.Conv2d(3, 8, kernel_size=3, padding=1), ConvMixer(8, 16),
                         ConvMixer(8, 16), nn.Conv2d(8, 2, kernel_size=1)), \
        torch.randn(2, 3, 5, 5)  # x [B, C, H, W]


MODELS = {"mlp": _mlp_model, "conv": _conv_model}


def _on_rank_compare(which):
    """Output, input gradient, the full gradient of every parameter, and that
    sync_replicated_gradients leaves the (already equal) replicated gradients unchanged."""
    group = dist.group.WORLD
    torch.manual_seed(0)  # the same model and data on every rank
    base, x = MODELS[which]()
    tp, _ = MODELS[which]()
    tp.load_state_dict(base.state_dict())
    apply_tensor_parallel(tp, group)
    dy_gen = torch.Generator().manual_seed(1)
    errors = {}
    outputs = {}
    for model in (base, tp):
        x_in = x.clone().requires_grad_()
        y = model(x_in)
        y.backward(torch.randn(y.shape, generator=dy_gen.manual_seed(1)))
        outputs[model] = (y, x_in.grad)
    errors["y"] = max_rel_error(outputs[tp][0], outputs[base][0])
    errors["dx"] = max_rel_error(outputs[tp][1], outputs[base][1])
    before = {n: p.grad.clone() for n, p in tp.named_parameters()}
    sync_replicated_gradients(tp, group)
    base_params = dict(base.named_parameters())
    sharded = 0
    split = layouts(tp)
    for name, param in tp.named_parameters():
        dim = split[name].dim
        sharded += dim is not None
        full = param.grad if dim is None else all_gather_dim(param.grad, dim, group)
        errors["grad:" + name] = max_rel_error(full, base_params[name].grad)
        errors["sync changed:" + name] = max_rel_error(param.grad, before[name])
    errors["parameters lost in conversion"] = len(base_params) - len(dict(tp.named_parameters()))
    errors["no parameter was sharded"] = float(sharded == 0)
    return errors


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("which", ["mlp", "conv"])
def test_user_block_after_apply_tensor_parallel_matches_unsharded(pools, which, tp):
    assert_errors(pools(tp).run(_on_rank_compare, which), FP32_TOL, f"{which} tp={tp}")


def _block(col, row=None, col_path="col", row_path="row", **extra):
    """A model with one block declaring `col_path` / `row_path` (None: not declared), and
    any `extra` class attributes."""
    attrs = {"tp_column": col_path, **extra}
    if row_path is not None:
        attrs["tp_row"] = row_path
    block = type("Block", (nn.Module,), attrs)()
    block.col, block.row = col, row if row is not None else nn.Linear(8, 8)
    return nn.Sequential(nn.Linear(8, 8), block)


BAD = {
    "kernel_size": (lambda: _block(nn.Conv2d(8, 8, 3)), "kernel_size=(3, 3)"),
    "stride": (lambda: _block(nn.Conv2d(8, 8, 1, stride=2)), "stride=(2, 2)"),
    "padding": (lambda: _block(nn.Conv2d(8, 8, 1, padding=1)), "padding=(1, 1)"),
    "dilation": (lambda: _block(nn.Conv2d(8, 8, 1, dilation=2)), "dilation=(2, 2)"),
    "groups": (lambda: _block(nn.Conv2d(8, 8, 1, groups=2)), "groups=2"),
    "type": (lambda: _block(nn.Embedding(8, 8)), "Embedding cannot be made column-parallel"),
    "divisible": (lambda: _block(nn.Linear(8, 7)), "out_features=7 is not divisible"),
    "path": (lambda: _block(nn.Linear(8, 8), row_path="rows.0"), "no sublayer 'rows.0'"),
    "unpaired": (lambda: _block(nn.Linear(8, 8), row_path=None), "tp_row is missing"),
    "old and new names disagree": (lambda: _block(nn.Linear(8, 8), _tp_col="row"),
                                   "declares tp_column='col' and _tp_col='row'"),
    "nothing declared": (lambda: nn.Sequential(nn.Linear(8, 8)), "no block declaring"),
    "declared twice": (lambda: _block(nn.Linear(8, 8), row_path="col"), "'1.col' is declared "
                                                                         "twice"),
    "row not a layer": (lambda: _block(nn.Linear(8, 8), nn.LayerNorm(8)),
                        "LayerNorm cannot be made row-parallel"),
    "row divisible": (lambda: _block(nn.Linear(8, 8), nn.Linear(7, 8)),
                      "in_features=7 is not divisible"),
    "fused shape, older spelling": (
        lambda: _block(nn.Linear(8, 24), tp_column_shapes={"col": ((3, 4, 2), 1)}),
        "tp_column_shapes, which is no longer read",
        "plan['1.col'] = ColwiseParallel(output_shape=(3, 4, 2), split_dim=1)"),
}


def _on_rank_refusals():
    """Every bad model raises one ValueError, changes nothing, and leaves no rank waiting."""
    messages = {}
    for key, (make, *_) in BAD.items():
        model = make()
        before = [type(m) for m in model.modules()]
        try:
            apply_tensor_parallel(model, dist.group.WORLD)
            messages[key] = None
        except ValueError as e:
            messages[key] = str(e)
        if [type(m) for m in model.modules()] != before:
            messages[key] = "the model was changed before the error"
    dist.barrier()
    return messages


def test_unsupported_layers_are_refused_with_one_clear_error(pools):
    messages = pools(2).run(_on_rank_refusals)[0]
    for key, (_, *parts) in BAD.items():
        assert_one_line(messages[key], parts, key)


def test_a_subclass_declaration_overrides_its_base_whichever_name_each_uses():
    """The nearest class in the MRO decides, as for any attribute: a subclass that declares
    `tp_column` over a base declaring `_tp_col` is not a conflict. Group of one: no ranks."""
    class Base(nn.Module):
        _tp_col = "a"
        _tp_row = "c"

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)

    class Sub(Base):
        tp_column = "b"

    model = apply_tensor_parallel(nn.Sequential(Sub()), None)
    kinds = {name: type(getattr(model[0], name)).__name__ for name in "abc"}
    assert isinstance(model[0].b, PlannedColumn), kinds
    assert isinstance(model[0].a, nn.Linear), kinds


def test_a_declaration_on_the_module_itself_comes_before_its_class():
    """A model whose classes cannot be edited is declared on its modules. Group of one."""
    class Block(nn.Module):
        tp_column, tp_row = "a", "c"

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)

    declared, plain = Block(), Block()
    declared.tp_column = "b"  # this one module only
    model = apply_tensor_parallel(nn.Sequential(declared, plain), None)
    assert isinstance(model[0].b, PlannedColumn) and isinstance(model[0].a, nn.Linear)
    assert isinstance(model[1].a, PlannedColumn) and isinstance(model[1].b, nn.Linear)
    assert isinstance(model[0].c, PlannedRow) and isinstance(model[1].c, PlannedRow)


def test_the_preset_builds_the_plan_one_would_write_by_hand():
    """Classic TP is a plan: each declared column layer ColwiseParallel(), each row layer
    RowwiseParallel() (the whole activations in and out: `f` and `g`), whatever else holds a
    weight NoParallel(), a module holding split layers beside a weight of its own included,
    and each dropout. No ranks: the plan is read, nothing is split."""
    col, row, whole = ColwiseParallel(), RowwiseParallel(), NoParallel()
    mlp, _ = _mlp_model()
    assert classic_plan(mlp) == {
        "0": whole, "1.norm": whole, "1.net.0": col, "1.net.2": row,
        "2": whole, "2.gate": col, "2.up": col, "2.down": row, "3": whole}
    conv, _ = _conv_model()
    assert classic_plan(conv) == {
        "0": whole, "1.norm": whole, "1.expand": col, "1.project": row,
        "2.norm": whole, "2.expand": col, "2.project": row, "3": whole}
    with_dropout = nn.Sequential(nn.Dropout(0.1), FeedForward(8, 16),
                                 nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Dropout(0.0)))
    with_dropout[1].net.insert(2, nn.Dropout(0.3))  # between the column and the row layer
    with_dropout[1].tp_row = "net.3"
    assert classic_plan(with_dropout) == {
        "0": whole, "1.norm": whole, "1.net.0": col, "1.net.2": whole, "1.net.3": row,
        "2": whole, "2.1": whole}


def _on_rank_preset_against_hand_written(which):
    """The preset and parallelize_module with the hand-written plan: the same split weights,
    the same output."""
    from tensor_parallel_toy.apply import parallelize_module

    torch.manual_seed(0)
    base, x = MODELS[which]()
    col, row, whole = ColwiseParallel(), RowwiseParallel(), NoParallel()
    block = {"mlp": lambda i: {f"{i}.norm": whole, f"{i}.net.0": col, f"{i}.net.2": row},
             "conv": lambda i: {f"{i}.norm": whole, f"{i}.expand": col, f"{i}.project": row}}
    plan = {"0": whole, **block[which](1), "3": whole}
    plan.update(block[which](2) if which == "conv" else
                {"2": whole, "2.gate": col, "2.up": col, "2.down": row})
    models = []
    for split in (lambda m: apply_tensor_parallel(m, dist.group.WORLD),
                  lambda m: parallelize_module(m, dist.group.WORLD, plan)):
        model = MODELS[which]()[0]
        model.load_state_dict(base.state_dict())
        models.append(split(model))
    preset, by_hand = models
    errors = {"y": max_rel_error(preset(x), by_hand(x))}
    hand_params = dict(by_hand.named_parameters())
    preset_split, hand_split = layouts(preset), layouts(by_hand)
    for name, param in preset.named_parameters():
        errors[name] = max_rel_error(param, hand_params[name])
        errors["split differently: " + name] = float(
            preset_split[name].dim != hand_split[name].dim)
    errors["parameters"] = abs(len(hand_params) - len(dict(preset.named_parameters())))
    return errors


@pytest.mark.parametrize("which", ["mlp", "conv"])
def test_the_preset_equals_parallelize_module_with_the_hand_written_plan(pools, which):
    assert_errors(pools(2).run(_on_rank_preset_against_hand_written, which), 0.0, which)


def test_no_parallel_beside_split_layers_keeps_whole_only_its_own_weight():
    """The preset gives a block holding a weight of its own beside its split layers NoParallel();
    that entry covers the block's own weight, not its other children: a child the plan leaves
    out is still refused at the first forward, naming its weight. Group of one."""
    model = nn.Sequential(GatedFeedForward(8, 12))
    model[0].unused = nn.Linear(8, 8)
    plan = classic_plan(model)
    assert plan.pop("0.unused") == NoParallel() and plan["0"] == NoParallel(), plan
    from tensor_parallel_toy.apply import parallelize_module

    with pytest.raises(ValueError) as info:
        parallelize_module(model, None, plan)(torch.randn(2, 3, 8))
    assert_one_line(str(info.value), ["'0.unused.weight'", "neither split nor kept whole"],
                    "a child NoParallel does not cover")


def test_overlap_is_refused_by_classic_tp_in_one_line():
    """Classic TP has no sequence collectives for the ring to overlap: overlap=True would be
    accepted and do nothing, so it is refused before the model changes. Group of one."""
    model, _ = _mlp_model()
    with pytest.raises(ValueError) as info:
        apply_tensor_parallel(model, None, overlap=True)
    assert_one_line(str(info.value), ["overlap=True", "classic TP"], "overlap")
    assert isinstance(model[1].net[0], nn.Linear)


def _on_rank_fused_conv():
    """A fused 1x1 conv given its output shape in the preset's plan, against one device:
    output, input gradient, every parameter's gradient against this rank's shard of one
    device's; and the same plan without the shape, whose output must differ."""
    from tensor_parallel_toy.apply import parallelize_module
    from tensor_parallel_toy.parallel_linear import shard

    group = dist.group.WORLD
    errors = {}
    for fused in (True, False):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Conv2d(3, 8, kernel_size=1), GatedConvMixer(8, 8))
        tp = nn.Sequential(nn.Conv2d(3, 8, kernel_size=1), GatedConvMixer(8, 8))
        tp.load_state_dict(base.state_dict())
        plan = classic_plan(tp)
        if fused:
            plan["1.expand"] = ColwiseParallel(output_shape=(2, 8), split_dim=1)
        parallelize_module(tp, group, plan)
        x = torch.randn(2, 3, 4, 4)
        grads = {}
        for model in (base, tp):
            x_in = x.clone().requires_grad_()
            y = model(x_in)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
            grads[model] = (y, x_in.grad)
        tag = "" if fused else "plain rows: "
        errors[tag + "y"] = max_rel_error(grads[tp][0], grads[base][0])
        if fused:
            errors["dx"] = max_rel_error(grads[tp][1], grads[base][1])
            full = dict(base.named_parameters())
            split = layouts(tp)
            for name, param in tp.named_parameters():
                errors["grad:" + name] = max_rel_error(
                    param.grad, shard(full[name].grad, split[name], group))
    return errors


def test_a_fused_conv_given_its_output_shape_in_the_plan_matches_unsharded(pools):
    per_rank = pools(2).run(_on_rank_fused_conv)
    for rank, errors in enumerate(per_rank):
        plain = errors.pop("plain rows: y")
        assert plain > 1e-3, f"rank {rank}: plain rows matched one device ({plain:.3g})"
    assert_errors(per_rank, FP32_TOL, "fused conv")
