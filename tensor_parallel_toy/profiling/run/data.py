"""A small, learnable, deterministic text dataset: no download, the same batches everywhere.

The corpus is generated from a tiny grammar (subject, verb, object, ending) with a seeded
generator, then read as bytes, so token ids are ASCII codes (< 128). A byte-level model learns
its spelling and word order within a few dozen steps, which makes the loss curves fall visibly
in a short profile run instead of hovering at log(vocab) as they do on random tokens.

`batch(corpus, step, batch_size, seq_len, seed)` is a pure function of its arguments: every
mode and every rank draws exactly the same global batch for a given step.
"""
import random

import torch

CORPUS_VOCAB = 128  # ASCII: every token id is below this

_SUBJECTS = ["the rank", "each shard", "a tensor", "the ring", "the gradient", "one layer",
             "the head", "a norm weight", "the next chunk", "every block", "the optimizer",
             "our model"]
_VERBS = ["sends", "gathers", "scatters", "reduces", "holds", "waits for", "multiplies",
          "splits", "receives", "sums", "copies", "updates"]
_OBJECTS = ["its own rows", "a partial sum", "the full sequence", "half of the heads",
            "the weight shard", "a slice of the vocabulary", "the previous chunk", "the logits",
            "its neighbour", "the residual stream"]
_ENDINGS = [".", " again.", " in order.", " while the gemm runs.", " before the wait.",
            " on every step."]


def make_corpus(num_sentences=4000, seed=0):
    """A 1-D uint8 tensor of ASCII text, ~150 KB at the default size, the same on every call."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS))
        sentence = " ".join(words) + rng.choice(_ENDINGS)
        sentences.append(sentence[0].upper() + sentence[1:])
    text = " ".join(sentences) + " "
    return torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8)


def batch(corpus, step, batch_size, seq_len, seed=0, device=None):
    """The global batch of `step`: input ids and next-token labels, both `[batch_size, seq_len]`
    int64, cut from random windows of the corpus with a generator seeded by (seed, step), on
    `device` (None: the CPU; a rank passes `current_device()`, its GPU under NCCL)."""
    if seq_len + 1 > corpus.numel():
        raise ValueError(f"sequence length {seq_len} is longer than the corpus "
                         f"({corpus.numel()} tokens)")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()]).long()
    windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]  # [b, s] inputs, [b, s] labels shifted by one
