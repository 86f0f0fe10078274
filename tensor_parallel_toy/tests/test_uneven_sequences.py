"""Sequence lengths the TP size does not divide: the model pads them, and nothing shows.

The baseline runs the unpadded sequence; the TP model must give logits of the original
length, the same loss and the same gradients (labels of the padding are ignored, and causal
attention hides the padding from the real tokens).
"""
import pytest
import torch.distributed as dist

from tensor_parallel_toy import ModelConfig, Transformer

from .helpers import (assert_errors, assert_matches_baseline, compare_on_world, max_rel_error,
                      random_batch)

CONFIG = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12,
                     ffn_hidden_size=96, max_seq_len=32)

# (tp, seq, overlap): 1 token (3 of padding at TP 4), odd lengths, and max_seq_len itself,
# which TP 3 pads past max_seq_len (33).
CASES = [(2, 7, False), (3, 32, True), (4, 1, False), (4, 10, True)]


@pytest.mark.parametrize("tp,seq,overlap", CASES,
                         ids=[f"tp{tp}-seq{s}-{'overlap' if o else 'basic'}" for tp, s, o in CASES])
def test_uneven_sequence_gives_the_unpadded_logits_loss_and_gradients(pools, tp, seq, overlap):
    per_rank = pools(tp).run(compare_on_world, CONFIG, overlap=overlap, seq=seq)
    assert_matches_baseline(per_rank, CONFIG, f"tp={tp} seq={seq} overlap={overlap}")


def _on_rank_per_token_loss(seq):
    """reduction="none" returns [b, s] (the padding cut off), equal to the baseline's; the
    `loss` alias passes every keyword on to `forward`."""
    dev_batch = random_batch(CONFIG, 2, seq, seed=3, ignore_frac=0.3)
    base = Transformer(CONFIG, seed=1)
    tp = Transformer(CONFIG, tp_group=dist.group.WORLD, seed=1)
    per_token = {m: m(*dev_batch, reduction="none") for m in (base, tp)}
    alias = tp.loss(*dev_batch, reduction="none")
    return {"loss[b, s]": max_rel_error(per_token[tp], per_token[base]),
            "model.loss == model(ids, labels)": max_rel_error(alias, per_token[tp])}


def test_per_token_loss_of_an_uneven_sequence_has_the_original_length(pools):
    assert_errors(pools(3).run(_on_rank_per_token_loss, 7), 1e-5, "per-token loss, tp=3, seq=7")
