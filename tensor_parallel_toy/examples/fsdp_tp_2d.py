"""2-D parallelism: FSDP2 over data parallel x TP + SP, on a 2 x 2 grid of ranks, each step's
loss checked against the same model trained on the whole batch on one device.

    python -m tensor_parallel_toy.examples.fsdp_tp_2d                       # 4 local CPU ranks
    torchrun --nproc-per-node 4 -m tensor_parallel_toy.examples.fsdp_tp_2d

Ranks 0,1 and 2,3 are two TP groups, each holding one copy of the model split in two; ranks 0,2
and 1,3 are the DP groups, over which FSDP2 shards each TP shard again and averages the
gradients. Every TP pair sees its own half of each global batch. Prints both losses per step
and exits non-zero when a step differs by more than the tolerance.
"""
import os

import torch

from tensor_parallel_toy import (ModelConfig, Transformer, current_device, guard, launch,
                                 load_full_state_dict)
from tensor_parallel_toy.comm import all_reduce_
from tensor_parallel_toy.interop.data_parallel import (apply_fsdp, data_parallel_loss, init_mesh_2d,
                                               split_batch)
from tensor_parallel_toy.profiling.run.data import CORPUS_VOCAB, batch, make_corpus

CONFIG = ModelConfig(vocab_size=CORPUS_VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                     ffn_hidden_size=64, max_seq_len=32)
DP, TP = 2, 2
STEPS, GLOBAL_BATCH, SEQ, LR = 3, 4, 16, 1e-2
TOL = 1e-4  # fp32: the grid only changes the order of additions


def run_rank():
    """The 2-D model and the one-device model trained side by side; returns both loss lists."""
    corpus = make_corpus()
    mesh = init_mesh_2d(DP, TP)  # dimensions ("dp", "tp"); every rank calls it
    device = current_device()  # this rank's GPU under NCCL, else the CPU
    baseline = Transformer(CONFIG, seed=0).to(device)
    # Under FSDP2 the gradient watch's end-of-backward is not ordered against FSDP2's own:
    # the other checks only (guards/replicated_grads.py says what to call instead).
    model = guard(Transformer(CONFIG, tp_group=mesh["tp"].get_group(), overlap=True,
                              seed=0).to(device), check_replicated_grads=None)
    load_full_state_dict(model, baseline.state_dict())  # before FSDP shards it
    apply_fsdp(model, mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, baseline)]
    losses = {"2d": [], "one_device": []}
    for step in range(STEPS):
        ids, labels = batch(corpus, step, GLOBAL_BATCH, SEQ, device=device)  # the global batch
        dp_group = mesh["dp"].get_group()
        mine = data_parallel_loss(model, split_batch(ids, dp_group), split_batch(labels, dp_group),
                                  dp_group)  # this rank's share: the mean over DP is the loss
        whole = baseline(ids, labels)
        for loss in (mine, whole):
            loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses["2d"].append(all_reduce_(mine.detach().clone(), dp_group).item() / DP)
        losses["one_device"].append(whole.item())
    return losses


def report(result):
    for step, (a, b) in enumerate(zip(result["2d"], result["one_device"])):
        print(f"step {step}: 2-D loss {a:.6f}  one-device loss {b:.6f}")
    diff = max(abs(a - b) for a, b in zip(result["2d"], result["one_device"]))
    if not diff <= TOL:
        raise SystemExit(f"2-D losses differ from one device's by {diff:.3g}, more than {TOL:g}")
    print(f"2-D losses equal one device's (max difference {diff:.2g}, tolerance {TOL:g})")


if __name__ == "__main__":
    started = int(os.environ.get("WORLD_SIZE", DP * TP))
    if started != DP * TP:  # before any process group: one line, not a mesh error per rank
        raise SystemExit(f"fsdp_tp_2d runs on a {DP} x {TP} grid, {DP * TP} ranks; torchrun "
                         f"started {started}: use torchrun --nproc-per-node {DP * TP}")
    results = launch(run_rank, DP * TP)  # under torchrun: this rank's result only
    if os.environ.get("RANK", "0") == "0":
        report(results[0])
