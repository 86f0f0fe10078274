"""Train the package's Transformer with TP + SP and overlapped communication, and check that
every step's loss equals the same model's on one device.

    python -m tensor_parallel_toy.examples.train_tp                         # 2 local CPU ranks
    torchrun --nproc-per-node 2 -m tensor_parallel_toy.examples.train_tp

Prints the TP loss and the one-device loss of each step, then the largest difference and the
tolerance; exits non-zero when a step differs by more.
"""
import os

import torch
import torch.distributed as dist

from tensor_parallel_toy import (ModelConfig, Transformer, current_device, guard, launch,
                                 load_full_state_dict)
from tensor_parallel_toy.profiling.run.data import CORPUS_VOCAB, batch, make_corpus

CONFIG = ModelConfig(vocab_size=CORPUS_VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                     ffn_hidden_size=64, max_seq_len=32)
STEPS, BATCH, SEQ, LR = 4, 2, 16, 1e-2
TOL = 1e-4  # fp32: TP only changes the order of additions


def train(model, corpus):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, labels = batch(corpus, step, BATCH, SEQ, device=current_device())  # every rank alike
        loss = model(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_rank():
    """TP over every rank, then the one-device baseline on each rank; returns both loss lists."""
    corpus, device = make_corpus(), current_device()
    baseline = Transformer(CONFIG, seed=0).to(device)
    # guard: the ranks agree on the model and each batch; replicated grads equal at backward 1
    tp = guard(Transformer(CONFIG, tp_group=dist.group.WORLD, overlap=True, seed=0).to(device))
    load_full_state_dict(tp, baseline.state_dict())  # the very same starting weights
    return {"tp": train(tp, corpus), "one_device": train(baseline, corpus)}


def report(result):
    for step, (a, b) in enumerate(zip(result["tp"], result["one_device"])):
        print(f"step {step}: TP loss {a:.6f}  one-device loss {b:.6f}")
    diff = max(abs(a - b) for a, b in zip(result["tp"], result["one_device"]))
    if not diff <= TOL:
        raise SystemExit(f"TP losses differ from one device's by {diff:.3g}, more than {TOL:g}")
    print(f"TP losses equal one device's (max difference {diff:.2g}, tolerance {TOL:g})")


if __name__ == "__main__":
    results = launch(run_rank, 2)  # under torchrun: this rank's result only
    if os.environ.get("RANK", "0") == "0":
        report(results[0])
