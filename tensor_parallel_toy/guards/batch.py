"""The batch a `Transformer` call receives, checked in one place, before any collective.

Two things make a batch wrong on a TP group. Its ranks may hold different batches (they would
compute the loss of no batch at all): `agreement.agree_on_batch` compares or broadcasts it.
Or the batch itself is malformed (wrong shape, too long, a token id or label outside the
vocabulary, a loss option F.cross_entropy would refuse): refused here. Every rank holds the
same batch once the first check has passed, so every rank raises the same one-line error.
"""
from ..config import check_seq_len
from .agreement import agree_on_batch


def check_token_ids(ids, vocab_size, what, ignore_index=None, check_ids=None):
    """Raise one line naming the first id outside 0..vocab_size-1 (ignore_index aside).

    The ids are the same on every rank, so every rank raises here, before any collective.
    `check_ids`: None (the default): only when `ids` is on the CPU, where it costs nothing; a
    GPU tensor is left alone, since reading it makes the host wait for the device every step.
    True: either (one device-to-host copy per checked tensor on a GPU). False: never.
    """
    if check_ids is False or (check_ids is None and ids.device.type != "cpu"):
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bad.any():
        value = ids[bad][0].item()
        extra = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"{what} {value} is out of range: valid are 0..{vocab_size - 1}{extra}")


def check_loss_options(label_smoothing, reduction):
    """What F.cross_entropy would refuse of its options, refused here with one line."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: valid are 'mean', 'sum', 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be between 0.0 and 1.0")


def check_batch(model, tp_group, input_ids, labels=None, *, ignore_index=-100,
                label_smoothing=0.0, reduction="mean", check_ids=None, same_batch="check"):
    """Refuse, in one line on every rank, whatever is wrong with a call of the package's
    `Transformer`: input_ids `[b, s]`, s from 1 to max_seq_len, ids and labels (`[b, s]`, or
    ignore_index) in the vocabulary (when `check_ids` says so), the loss options; the ranks of
    `tp_group` made to hold the same batch as `same_batch` says."""
    if labels is not None:
        check_loss_options(label_smoothing, reduction)
    batch = {"input_ids": input_ids} if labels is None else {"input_ids": input_ids,
                                                             "labels": labels}
    agree_on_batch(batch, tp_group, same_batch)  # first: then all ranks agree
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids of shape {list(input_ids.shape)}: expected [batch, seq]")
    check_seq_len(input_ids.shape[1], model.config.max_seq_len)
    vocab = model.config.vocab_size
    check_token_ids(input_ids, vocab, "token id", check_ids=check_ids)
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels of shape {list(labels.shape)} do not match input_ids "
                             f"of shape {list(input_ids.shape)}")
        check_token_ids(labels, vocab, "label", ignore_index, check_ids=check_ids)
