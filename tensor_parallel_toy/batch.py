"""The batch a `Transformer` call receives, checked in one place, before any collective.

Two things make a batch wrong on a TP group. Its ranks may hold different batches (they would
compute the loss of no batch at all): `agreement.agree_on_batch` compares or broadcasts it.
Or the batch itself is malformed (wrong shape, too long, a token id or label outside the
vocabulary, a loss option F.cross_entropy would refuse): refused here. Every rank holds the
same batch once the first check has passed, so every rank raises the same one-line error.
"""
from .agreement import agree_on_batch
from .config import check_seq_len
from .vocab_parallel import check_loss_options, check_token_ids


def check_batch(model, input_ids, labels=None, *, ignore_index=-100, label_smoothing=0.0,
                reduction="mean"):
    """Refuse, in one line on every rank, whatever is wrong with a call of `model`: input_ids
    `[b, s]`, s from 1 to max_seq_len, ids and labels (`[b, s]`, or ignore_index) in the
    vocabulary (checked when `model.check_ids` says so), the loss options; the ranks of
    `model.tp_group` made to hold the same batch as `model.same_batch` says."""
    if labels is not None:
        check_loss_options(label_smoothing, reduction)
    batch = {"input_ids": input_ids} if labels is None else {"input_ids": input_ids,
                                                             "labels": labels}
    agree_on_batch(batch, model.tp_group, model.same_batch)  # first: then all ranks agree
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids of shape {list(input_ids.shape)}: expected [batch, seq]")
    check_seq_len(input_ids.shape[1], model.config.max_seq_len)
    vocab = model.config.vocab_size
    check_token_ids(input_ids, vocab, "token id", check_ids=model.check_ids)
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels of shape {list(labels.shape)} do not match input_ids "
                             f"of shape {list(input_ids.shape)}")
        check_token_ids(labels, vocab, "label", ignore_index, check_ids=model.check_ids)
