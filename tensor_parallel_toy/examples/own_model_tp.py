"""Classic tensor parallelism on a model of your own: a plain nn.Module whose blocks name their
column and row layers, split over the ranks by `apply_tensor_parallel` (the plan
`classic_plan(model)` reads from those names, carried out by `parallelize_module`), checked
against the same model on one device.

    python -m tensor_parallel_toy.examples.own_model_tp                     # 2 local CPU ranks
    torchrun --nproc-per-node 2 -m tensor_parallel_toy.examples.own_model_tp

Prints the plan, then the largest difference from the one-device model in the output and in
the gradients (every parameter, each rank's slice of a split one); exits non-zero when one is
above the tolerance.
"""
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from tensor_parallel_toy.apply.classic_tp import (apply_tensor_parallel, classic_plan,
                                                  sync_replicated_gradients)
from tensor_parallel_toy import current_device, launch
from tensor_parallel_toy.support.sharding import named_layouts

TOL = 1e-5  # fp32: TP only changes the order of additions


class FeedForward(nn.Module):
    tp_column = "up"  # split by output features: each rank computes hidden/p of them
    tp_row = "down"  # split by input features: the ranks' partial outputs are summed

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # replicated: every rank holds all of it
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))  # relu acts on each feature


class MyModel(nn.Module):
    def __init__(self, dim=16, hidden=64, depth=2, classes=5):
        super().__init__()
        self.blocks = nn.Sequential(*[FeedForward(dim, hidden) for _ in range(depth)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):  # x [batch, dim] -> [batch, classes]
        return self.head(self.blocks(x))


def run_rank():
    """Returns the largest output and gradient differences from the one-device model
    ({"output", "gradients"}); raises if some parameter's gradient was not compared."""
    group = dist.group.WORLD
    device = current_device()  # this rank's GPU under NCCL, else the CPU
    torch.manual_seed(0)  # the same weights and batch on every rank
    baseline = MyModel().to(device)
    x, y = torch.randn(8, 16).to(device), torch.randint(0, 5, (8,)).to(device)
    # Each rank keeps its slices; after the first backward the ranks compare their gradients
    # of every weight left whole (norms, biases, the head), which must be equal.
    model = apply_tensor_parallel(copy.deepcopy(baseline), group)
    out, want = model(x), baseline(x)
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(want, y).backward()
    sync_replicated_gradients(model, group)
    full = dict(baseline.named_parameters())
    rank, p, grad_diff, checked = dist.get_rank(), dist.get_world_size(), 0.0, 0
    for name, param, layout in named_layouts(model):
        dim = layout.dim
        want_grad = full[name].grad if dim is None else full[name].grad.chunk(p, dim)[rank]
        grad_diff = max(grad_diff, (param.grad - want_grad).abs().max().item())
        checked += 1
    if checked != len(full):
        raise RuntimeError(f"checked {checked} gradients of the model's {len(full)}")
    return {"output": (out - want).abs().max().item(), "gradients": grad_diff}


def report(result):
    print("the plan apply_tensor_parallel carries out, read from tp_column / tp_row:")
    for name, style in classic_plan(MyModel()).items():
        print(f"  {name}: {type(style).__name__}()")
    print(f"output: max difference from one device {result['output']:.2g}")
    print(f"gradients: max difference from one device {result['gradients']:.2g}")
    worst = max(result.values())
    if not worst <= TOL:
        raise SystemExit(f"the TP model differs from one device's by {worst:.3g}, more than "
                         f"{TOL:g}")
    print(f"outputs and every gradient equal one device's (tolerance {TOL:g})")


if __name__ == "__main__":
    results = launch(run_rank, 2)  # under torchrun: this rank's result only
    if os.environ.get("RANK", "0") == "0":
        report(results[0])
