"""Vocab-parallel embedding and cross-entropy, and tied embeddings, against plain PyTorch; a
vocabulary the TP size does not divide, padded, against one device.

Worker functions (`_on_rank_*`) return error measures; the assertions run here.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tensor_parallel_toy import (ModelConfig, Transformer, VocabParallelEmbedding, guard,
                                 vocab_parallel_cross_entropy)
from tensor_parallel_toy.comm import gather_from_tensor_parallel_region
from tensor_parallel_toy.config import padded_vocab_size
from tensor_parallel_toy.parallel_linear import layout_of, shard

from .helpers import (CONFIG, FP32_TOL, assert_errors, assert_matches_baseline, assert_one_line,
                      compare_with_baseline, compare_on_world, max_rel_error, random_batch,
                      value_error_messages, world)

VOCAB, TOKENS = 24, 20  # 24: divisible by 2, 3 and 4
# Vocabularies 2, 3 and 4 do not divide, padded: 23 (one to three padding columns on the last
# rank) and 5 (at p = 4, 8 rows: rank 3 holds padding only).
ODD_VOCABS = (23, 5)


def _logits_and_labels(ignore_index, seed=0, vocab=VOCAB):
    """Full logits `[TOKENS, vocab]` and labels that hit every shard's first and last column
    and the ignored value."""
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(TOKENS, vocab, generator=gen)
    labels = torch.randint(0, vocab, (TOKENS,), generator=gen)
    # shard edges for p = 2, 3, 4 (for 24 and 23)
    labels[:8] = torch.tensor([0, 5, 6, 7, 11, 12, 18, vocab - 1]) % vocab
    labels[8:12] = ignore_index
    return logits, labels


def _padded_columns(vocab, p, r):
    """Bool per column of rank r's shard of the padded vocabulary: True on the padding."""
    width = padded_vocab_size(vocab, p) // p
    return r * width + torch.arange(width) >= vocab


def _on_rank_cross_entropy():
    """Loss and dlogits of every (vocabulary, ignore_index, label_smoothing, reduction) against
    F.cross_entropy in fp64 on the full logits. A padded vocabulary's padding columns hold
    logits of 1e4 (they would win any softmax they entered), and must get a gradient of exactly
    0 ("pad nonzero": how many did not)."""
    group, p, r = world()
    errors = {}
    for vocab in (VOCAB, *ODD_VOCABS):
        # The reductions run after the Function, the same for any vocabulary: once each.
        reductions = ("mean", "sum", "none") if vocab == VOCAB else ("none",)
        for ignore_index in (-100, 3):  # 3: a real class, ignored anyway
            for smoothing in (0.0, 0.1):
                for reduction in reductions:
                    logits, labels = _logits_and_labels(ignore_index, vocab=vocab)
                    dloss = torch.randn(TOKENS) if reduction == "none" else torch.tensor(1.7)
                    ref = logits.double().requires_grad_()
                    loss_ref = F.cross_entropy(ref, labels, ignore_index=ignore_index,
                                               label_smoothing=smoothing, reduction=reduction)
                    loss_ref.backward(dloss.double())
                    pad = padded_vocab_size(vocab, p) - vocab
                    padded = F.pad(logits, (0, pad), value=1e4)
                    local = padded.chunk(p, dim=-1)[r].clone().requires_grad_()
                    loss = vocab_parallel_cross_entropy(
                        local, labels, group, vocab_size=vocab if pad else None,
                        ignore_index=ignore_index, label_smoothing=smoothing,
                        reduction=reduction)
                    loss.backward(dloss)
                    key = f"vocab={vocab},ignore={ignore_index},smoothing={smoothing},{reduction}"
                    errors[key + ":loss"] = max_rel_error(loss, loss_ref)
                    want = F.pad(ref.grad, (0, pad)).chunk(p, dim=-1)[r]
                    errors[key + ":dlogits"] = max_rel_error(local.grad, want)
                    pad_grad = local.grad[:, _padded_columns(vocab, p, r)]
                    errors[key + ":pad nonzero"] = float((pad_grad != 0).sum())
    return errors


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _on_rank_largest_tensor_in_loss(use_full_logits):
    """Largest tensor created by forward + backward of the loss, against the local logits'
    size. `use_full_logits` gathers them first: what the vocab-parallel loss must not do."""
    group, p, r = world()
    logits, labels = _logits_and_labels(-100)
    local = logits.chunk(p, dim=-1)[r].clone().requires_grad_()
    with _LargestTensor() as mode:
        if use_full_logits:
            loss = F.cross_entropy(gather_from_tensor_parallel_region(local, group), labels)
        else:
            loss = vocab_parallel_cross_entropy(local, labels, group)
        loss.backward()
    return mode.largest / local.numel()


def _on_rank_largest_tensor_in_model_loss(use_full_logits):
    """Largest tensor created by forward + backward of the model's loss, over b*s*V (the full
    logits). `use_full_logits`: F.cross_entropy on model(ids), which gathers them."""
    config = ModelConfig(vocab_size=192, hidden_size=48, num_layers=1, num_heads=12,
                         ffn_hidden_size=96, max_seq_len=32)
    model = Transformer(config, tp_group=dist.group.WORLD)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with _LargestTensor() as mode:
        if use_full_logits:
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        else:
            loss = model.loss(ids, ids)
        loss.backward()
    return mode.largest / ids.numel() / config.vocab_size


def _on_rank_embedding(vocab):
    """VocabParallelEmbedding against nn.Embedding (fp64): output rows and weight gradient (a
    padded vocabulary's padding rows: zeros from the layer's own init, gradient exactly 0)."""
    group, p, r = world()
    seq, batch, dim = 12, 2, 6
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(vocab, dim, generator=gen)
    ids = torch.randint(0, vocab, (seq, batch), generator=gen)
    ids[:8, 0] = torch.tensor([0, 5, 6, 7, 11, 12, 18, vocab - 1])  # shard edges
    dy = torch.randn(seq, batch, dim, generator=gen)
    ref = table.double().requires_grad_()
    y_ref = F.embedding(ids, ref)
    y_ref.backward(dy.double())
    layer = VocabParallelEmbedding(vocab, dim, tp_group=group)
    padding = _padded_columns(vocab, p, r)
    errors = {"pad init nonzero": float((layer.weight[padding] != 0).sum())}
    with torch.no_grad():
        layer.weight.copy_(shard(table, layout_of(layer, "weight"), group))
    y = layer(ids)  # [s/p, b, h]
    y.backward(dy.chunk(p)[r])
    want = shard(ref.grad, layout_of(layer, "weight"), group)  # the padding: zeros
    return {**errors, "y": max_rel_error(y, y_ref.chunk(p)[r]),
            "dweight": max_rel_error(layer.weight.grad, want),
            "pad grad nonzero": float((layer.weight.grad[padding] != 0).sum())}


def _on_rank_bad_inputs():
    """Each must raise one ValueError on every rank before any collective."""
    group, p, _ = world()
    config = ModelConfig(vocab_size=VOCAB, hidden_size=24, num_layers=1, num_heads=4,
                         ffn_hidden_size=24, max_seq_len=16)
    model = guard(Transformer(config, tp_group=group))
    padded = guard(Transformer(dataclasses.replace(config, vocab_size=VOCAB - 1), tp_group=group))
    ids = torch.zeros(2, 5, dtype=torch.long)
    cases = {"padding id": lambda: padded(torch.full_like(ids, VOCAB - 1)),  # a padding row's
             "padding label": lambda: padded.loss(ids, torch.full_like(ids, VOCAB - 1)),
             "label": lambda: model.loss(ids, torch.full_like(ids, VOCAB)),
             "token id": lambda: model(torch.full_like(ids, -1)),
             "label_smoothing": lambda: model.loss(ids, ids, label_smoothing=1.5),
             "reduction": lambda: model.loss(ids, ids, reduction="avg"),
             "labels shape": lambda: model.loss(ids, ids[:, :4]),
             "sequence length": lambda: model(torch.zeros(2, 17, dtype=torch.long))}
    return value_error_messages(cases)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocab_parallel_cross_entropy_equals_F_cross_entropy(pools, tp):
    assert_errors(pools(tp).run(_on_rank_cross_entropy), FP32_TOL, f"cross-entropy tp={tp}")


def test_vocab_parallel_cross_entropy_never_materializes_full_logits(pools):
    ratios = pools(4).run(_on_rank_largest_tensor_in_loss, False)
    assert max(ratios) <= 1.0, f"largest tensor / local logits = {ratios} (must be <= 1)"
    # The check can fail: gathering the logits first makes a tensor 4x the local logits.
    gathered = pools(4).run(_on_rank_largest_tensor_in_loss, True)
    assert min(gathered) >= 4.0, gathered


def test_model_loss_never_materializes_full_logits(pools):
    ratios = pools(4).run(_on_rank_largest_tensor_in_model_loss, False)
    assert max(ratios) < 1.0, f"largest tensor / full logits = {ratios} (must be < 1)"
    gathered = pools(4).run(_on_rank_largest_tensor_in_model_loss, True)
    assert min(gathered) >= 1.0, gathered  # the check can fail


@pytest.mark.parametrize("tp,vocab", [(2, VOCAB), (4, VOCAB), (2, 23), (3, 23)])
def test_vocab_parallel_embedding_equals_nn_embedding(pools, tp, vocab):
    assert_errors(pools(tp).run(_on_rank_embedding, vocab), FP32_TOL,
                  f"embedding tp={tp} vocab={vocab}")


def _on_rank_padded_model(config, options):
    """compare_with_baseline (logits, loss with label smoothing, every full gradient, the grad
    norm, the parameters after an SGD step), and this rank's padding rows of the embedding and
    the head after a backward: zeros, with a gradient of exactly 0 ("pad nonzero": how many
    not)."""
    group, p, r = world()
    errors = compare_with_baseline(config, group, label_smoothing=0.1, steps=1, **options)
    model = Transformer(config, tp_group=group, **options)
    model.loss(*random_batch(config, 2, 12, seed=0), label_smoothing=0.1).backward()
    padding = _padded_columns(config.vocab_size, p, r)
    for name in ("embed.weight", "head.weight"):
        weight = model.get_parameter(name)
        errors[f"{name} pad nonzero"] = float((weight[padding] != 0).sum()
                                              + (weight.grad[padding] != 0).sum())
    return errors


# 97: 98, 99, 100 rows at TP 2, 3, 4: one to three padding rows on the last rank.
PADDED = [(2, True, {}), (3, False, {"overlap": True}), (4, False, {"sequence_parallel": False})]


@pytest.mark.parametrize("tp,tied,options", PADDED, ids=["tp2-tied", "tp3-overlap",
                                                         "tp4-classic"])
def test_a_vocabulary_the_tp_size_does_not_divide_is_padded_and_equals_one_device(pools, tp,
                                                                                 tied, options):
    config = dataclasses.replace(CONFIG, vocab_size=97, tie_embeddings=tied, num_layers=1)
    per_rank = pools(tp).run(_on_rank_padded_model, config, options)
    worst = assert_matches_baseline(per_rank, config, f"vocab 97 tp={tp} {options}")
    assert "logits" in worst and "grad:embed.weight" in worst, sorted(worst)


@pytest.mark.parametrize("tp,overlap", [(2, False), (4, True)])
def test_tied_embeddings_one_weight_gets_both_gradients(pools, tp, overlap):
    config = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12,
                         ffn_hidden_size=96, max_seq_len=32, tie_embeddings=True)
    names = [n for n, _ in Transformer(config).named_parameters()]
    assert "embed.weight" in names and "head.weight" not in names, names
    per_rank = pools(tp).run(compare_on_world, config, overlap=overlap, label_smoothing=0.1)
    worst = assert_matches_baseline(per_rank, config, f"tied tp={tp} overlap={overlap}")
    assert "grad:embed.weight" in worst


def test_bad_labels_and_ids_raise_one_clear_error_before_any_collective(pools):
    messages = pools(2).run(_on_rank_bad_inputs)[0]
    expected = {"padding id": [f"token id {VOCAB - 1}", f"0..{VOCAB - 2}"],
                "padding label": [f"label {VOCAB - 1}", f"0..{VOCAB - 2}"],
                "label": [f"label {VOCAB}", f"0..{VOCAB - 1}", "ignore_index=-100"],
                "token id": ["token id -1", f"0..{VOCAB - 1}"],
                "label_smoothing": ["label_smoothing=1.5"],
                "reduction": ["reduction='avg'", "'mean'"],
                "labels shape": ["[2, 4]", "[2, 5]"],
                "sequence length": ["sequence length 17", "max_seq_len=16"]}
    for key, parts in expected.items():
        assert_one_line(messages[key], parts, key)


class _HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (on a GPU: a device sync)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "tolist")
        return func(*args, **(kwargs or {}))


def _on_rank_host_reads():
    """How often one step reads values back to the host, with the checks on (CPU default) and
    off (what a GPU batch gets by default), after the first step (whose backward also compares
    the replicated gradients, once); and that a guarded embedding on its own checks its ids."""
    group, _, _ = world()
    config = ModelConfig(vocab_size=VOCAB, hidden_size=24, num_layers=1, num_heads=4,
                         ffn_hidden_size=24, max_seq_len=16)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    reads = {}
    for check_ids in (None, False):
        model = guard(Transformer(config, tp_group=group), check_ids=check_ids)
        model.loss(ids, ids).backward()  # the first backward's gradient check, done once
        with _HostReads() as loss_reads:
            model.loss(ids, ids).backward()
        with _HostReads() as forward_reads:
            model(ids)
        reads[f"check_ids={check_ids}"] = (loss_reads.count, forward_reads.count)
    messages = value_error_messages({
        "embedding": lambda: guard(VocabParallelEmbedding(VOCAB, 4, tp_group=group))(
            torch.full((4, 2), VOCAB))})
    return reads, messages


def test_the_batch_is_checked_once_per_call_and_never_read_back_when_checks_are_off(pools):
    reads, messages = pools(2).run(_on_rank_host_reads)[0]
    # One read per checked tensor (ids and labels in loss, ids in forward), plus one of the
    # ranks' verdict on whether they hold the same batch; none anywhere else in forward +
    # backward, so a GPU step (id checks off by default) waits for the device once per call.
    assert reads == {"check_ids=None": (3, 2), "check_ids=False": (1, 1)}, reads
    assert messages["embedding"] and f"token id {VOCAB} is out of range" in messages["embedding"]
