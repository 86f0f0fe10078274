"""Train a tiny byte-level model with TP + SP on 2 CPU ranks, then generate text with it under
TP and check that one device, given the same weights, generates the same tokens: run it with
`python -m tensor_parallel_toy.examples.generate_tp` (or under `torchrun --nproc-per-node 2`).

Generation is not the training forward: one token per sequence at each step leaves sequence
parallelism nothing to split, so `generate` runs the same weight shards as classic TP (two
all-reduces of `[batch, hidden]` per block) with a KV cache of this rank's k/v heads
(inference/generate.py).
"""
import argparse
import os

import torch
import torch.distributed as dist

from tensor_parallel_toy import (ModelConfig, Transformer, current_device, full_state_dict, guard,
                                 launch)
from tensor_parallel_toy.inference.generate import generate
from tensor_parallel_toy.profiling.run.data import CORPUS_VOCAB, batch, make_corpus

CONFIG = ModelConfig(vocab_size=CORPUS_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, ffn_hidden_size=128, max_seq_len=64, mlp="swiglu")
PROMPTS = ["The ring ", "Each shard sends "]


def encode(prompts):
    """ASCII bytes, left-padded with 0s to the longest prompt, and the attention mask."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, text in enumerate(prompts):
        ids[i, longest - len(text):] = torch.tensor(list(text.encode("ascii")))
        mask[i, longest - len(text):] = 1
    return ids, mask


def decode(tokens, mask):
    return ["".join(chr(t) for t, m in zip(row.tolist(), keep.tolist()) if m)
            for row, keep in zip(tokens, mask)]


def run_rank(steps=300, new_tokens=40):
    """Train under TP, then generate greedily and sampled under TP and on one device."""
    corpus, device = make_corpus(), current_device()  # this rank's GPU under NCCL, else CPU
    tp = guard(Transformer(CONFIG, tp_group=dist.group.WORLD, overlap=True, seed=0).to(device))
    optimizer = torch.optim.AdamW(tp.parameters(), lr=3e-3)
    for step in range(steps):
        ids, labels = batch(corpus, step, 8, 32, device=device)
        tp(ids, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    one = Transformer(CONFIG, seed=1).to(device)
    one.load_state_dict(full_state_dict(tp))  # the very same weights, on one device
    ids, mask = (t.to(device) for t in encode(PROMPTS))
    out = {}
    for name, kwargs in [("greedy", {}), ("sampled", dict(do_sample=True, temperature=0.7,
                                                           top_k=10, seed=0))]:
        args = dict(max_new_tokens=new_tokens, **kwargs)
        out[name] = (generate(tp.eval(), ids, mask, **args), generate(one.eval(), ids, mask,
                                                                       **args))
    out["mask"] = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, new_tokens)], 1)
    return {name: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu()
            for name, v in out.items()}  # home to the launcher


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300,
                   help="training steps before generating (300: about 20 s, readable words)")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps {args.steps}: must be 0 or more")
    results = launch(run_rank, 2, args.steps)
    if os.environ.get("RANK", "0") != "0":
        return 0
    out = results[0]
    for name in ("greedy", "sampled"):
        tp_tokens, one_tokens = out[name]
        for text in decode(tp_tokens, out["mask"]):
            print(f"{name}: {text!r}")
        same = torch.equal(tp_tokens, one_tokens)
        print(f"{name}: the TP tokens {'equal' if same else 'DIFFER FROM'} one device's")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
