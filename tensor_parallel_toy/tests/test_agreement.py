"""Ranks that disagree fail loudly: a model built differently on one rank raises on every rank
within seconds, naming the field and each rank's value, at the cost of one tiny collective."""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tensor_parallel_toy import (ColumnParallelLinear, ModelConfig, RowParallelLinear,
                                 Transformer, VocabParallelEmbedding, guard)
from tensor_parallel_toy.apply import ColwiseParallel, RowwiseParallel, parallelize_module
from tensor_parallel_toy.support.sharding import full_grads
from tensor_parallel_toy.guards.agreement import check_ranks_agree, module_fingerprint
from tensor_parallel_toy.interop.data_parallel import init_mesh_2d
from tensor_parallel_toy.profiling.measure.transfers import recording
from tensor_parallel_toy.tests.helpers import (MODEL_FP32_TOL, assert_errors, max_rel_error,
                                            value_error_messages, world)

from .helpers import assert_one_line

RAISE_WITHIN_S = 10


def _config(hidden=32):
    return ModelConfig(vocab_size=64, hidden_size=hidden, num_layers=1, num_heads=4,
                       ffn_hidden_size=64, max_seq_len=16)


class _Counter:
    """A recording that counts the transfers and their bytes (profiling/measure/transfers.py)."""

    def __init__(self):
        self.kinds, self.bytes = [], 0

    def transfer(self, kind, nbytes, post, stream=None):
        self.kinds.append(kind)
        self.bytes += nbytes
        return post()


def _on_rank_disagreeing_builds():
    """Each case builds something that differs on rank 1; returns {case: (message, seconds)}."""
    group, _, rank = world()
    one = rank == 1
    cases = {
        "hidden": lambda: guard(Transformer(_config(64 if one else 32), tp_group=group)),
        "overlap": lambda: guard(Transformer(_config(), tp_group=group, overlap=one)),
        "seed": lambda: guard(Transformer(_config(), tp_group=group, seed=rank)),
        "column dtype": lambda: guard(ColumnParallelLinear(
            8, 16, tp_group=group, dtype=torch.bfloat16 if one else torch.float32)),
        "row bias": lambda: guard(RowParallelLinear(16, 8, tp_group=group, bias=one)),
        "embedding": lambda: guard(VocabParallelEmbedding(64, 12 if one else 8, tp_group=group)),
        "own module": lambda: check_ranks_agree(
            module_fingerprint(nn.Linear(4, 6 if one else 4), tp_size=2), group, "blocks"),
    }
    timed = {}
    for key, fn in cases.items():
        start = time.perf_counter()
        message = value_error_messages({key: fn})[key]
        timed[key] = (message, time.perf_counter() - start)
    return timed


def test_ranks_that_build_different_models_raise_on_every_rank_naming_each_value(pools):
    per_rank = pools(2).run(_on_rank_disagreeing_builds)
    expected = {
        "hidden": ["Transformers", "config.hidden_size: 32 on rank 0, 64 on rank 1", "more)"],
        "overlap": ["overlap: False on rank 0, True on rank 1"],
        "seed": ["seed: 0 on rank 0, 1 on rank 1"],
        "column dtype": ["ColumnParallelLinears", "weight: [8, 8] float32 on rank 0, "
                                                  "[8, 8] bfloat16 on rank 1"],
        "row bias": ["RowParallelLinears", "bias: <absent> on rank 0, [8] float32 on rank 1"],
        "embedding": ["VocabParallelEmbeddings", "weight: [32, 8] float32 on rank 0, "
                                                 "[32, 12] float32 on rank 1"],
        "own module": ["blocks", "weight: [4, 4] float32 on rank 0, [6, 4] float32 on rank 1"],
    }
    for rank, messages in enumerate(per_rank):
        for key, words in expected.items():
            message, seconds = messages[key]
            assert_one_line(message, words, f"rank {rank}, {key}")
            assert seconds < RAISE_WITHIN_S, f"rank {rank}, {key}: raised after {seconds:.1f} s"
    assert per_rank[0] and {k: m for k, (m, _) in per_rank[0].items()} == \
        {k: m for k, (m, _) in per_rank[1].items()}, "the ranks raised different messages"


def _mlp(seed):
    """The same small MLP on every rank, whatever the ranks drew before."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _on_rank_construction_transfers():
    """The transfers each construction makes when the ranks agree: {what: [kinds], bytes}."""
    group, _, _ = world()
    built = {}
    for what, build in {
        "Transformer": lambda: guard(Transformer(_config(), tp_group=group, overlap=True)),
        "ColumnParallelLinear": lambda: guard(ColumnParallelLinear(8, 16, tp_group=group)),
        "RowParallelLinear": lambda: guard(RowParallelLinear(16, 8, tp_group=group, bias=True)),
        "VocabParallelEmbedding": lambda: guard(VocabParallelEmbedding(64, 8, tp_group=group)),
        # A door that splits the model compares it once, before the split, not again after.
        "a plan": lambda: parallelize_module(_mlp(seed=0), group,
                                             {"0": ColwiseParallel(), "2": RowwiseParallel()}),
    }.items():
        with recording(_Counter()) as counter:
            build()
        built[what] = (counter.kinds, counter.bytes)
    dist.barrier()
    return built


def test_guarding_a_model_or_layer_costs_one_tiny_all_gather(pools):
    """Not one per layer: the whole model is compared once, when it is guarded, and a plan's
    model once, before its split (the guard's checks then attached without a second)."""
    for rank, built in enumerate(pools(2).run(_on_rank_construction_transfers)):
        for what, (kinds, nbytes) in built.items():
            assert kinds == ["all-gather"] and nbytes == 8, f"rank {rank}, {what}: {kinds}, " \
                                                           f"{nbytes} bytes"


# ----------------------------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------------------------
def _batch(seed, seq=8):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, seq), generator=gen)
    return ids, torch.randint(0, 64, (2, seq), generator=gen)


def _on_rank_different_batches():
    """Rank 1's batch differs from rank 0's in one way per case; every rank must raise."""
    group, _, rank = world()
    check = guard(Transformer(_config(), tp_group=group))
    broadcast = guard(Transformer(_config(), tp_group=group), same_batch="broadcast")
    ids, labels = _batch(0)
    other = ids.clone()
    other[1, 5] = (other[1, 5] + 1) % 64  # one token of 16
    one = rank == 1
    return value_error_messages({
        "ids": lambda: check.loss(other if one else ids, labels),
        "labels": lambda: check.loss(ids, other if one else labels),
        "forward": lambda: check(other if one else ids),
        "shape": lambda: check.loss(*_batch(0, seq=9 if one else 8)),
        "broadcast shape": lambda: broadcast.loss(*_batch(0, seq=9 if one else 8)),
        "option": lambda: guard(Transformer(_config(), tp_group=group), same_batch="rank0"),
    })


def test_ranks_given_different_batches_raise_on_every_rank_never_a_number(pools):
    per_rank = pools(2).run(_on_rank_different_batches)
    expected = {
        "ids": ["different input_ids", "checksums:", "on rank 0", "on rank 1",
                "same_batch='broadcast'"],
        "labels": ["different labels", "on rank 1"],
        "forward": ["different input_ids"],
        "shape": ["input_ids of different shapes: (2, 8) on rank 0, (2, 9) on rank 1"],
        "broadcast shape": ["input_ids of different shapes: (2, 8) on rank 0, (2, 9) on rank 1"],
        "option": ["same_batch='rank0'", "'check'", "'broadcast'"],
    }
    for rank, messages in enumerate(per_rank):
        for key, words in expected.items():
            assert_one_line(messages[key], words, f"rank {rank}, {key} (no error: a number)")


def _on_rank_bare_model_with_different_batches():
    """A bare TP model (no guard), as a reader of model.py builds it, given another batch on
    rank 1: what it says, once, and that a guarded one says nothing."""
    import warnings

    group, _, rank = world()
    bare = Transformer(_config(), tp_group=group)
    guarded = guard(Transformer(_config(), tp_group=group))
    ids, labels = _batch(0)
    other = _batch(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare(other if rank == 1 else ids, labels)
        bare(ids, labels)  # a second call: said once per model
        said_bare = [str(w.message) for w in caught]
        caught.clear()
        guarded(ids, labels)
        said_guarded = [str(w.message) for w in caught]
    return said_bare, said_guarded


def test_a_bare_tp_model_says_once_on_every_rank_that_it_is_unchecked_naming_guard(pools):
    """Unguarded, ranks given different batches would all return a mixed loss, silently:
    the model says so at its first forward, on every rank, naming the call that checks."""
    for rank, (bare, guarded) in enumerate(pools(2).run(
            _on_rank_bare_model_with_different_batches)):
        assert len(bare) == 1, f"rank {rank}: {bare}"
        assert_one_line(bare[0], ["unchecked", "different batches", "guard(model)"],
                        f"rank {rank}")
        assert guarded == [], f"rank {rank}: a guarded model warned: {guarded}"


def _on_rank_broadcast_batch():
    """same_batch="broadcast": rank 1 passes another batch of the same shape; the loss and every
    gradient must be the baseline's on rank 0's batch, and rank 1's tensors now hold it."""
    group, _, rank = world()
    config = _config()
    ids, labels = _batch(0)
    model = guard(Transformer(config, tp_group=group, seed=3), same_batch="broadcast")
    mine_ids, mine_labels = (ids, labels) if rank == 0 else _batch(1)
    loss = model.loss(mine_ids, mine_labels)
    loss.backward()
    baseline = Transformer(config, seed=3)
    expected = baseline.loss(ids, labels)
    expected.backward()
    errors = {"loss": max_rel_error(loss.detach(), expected.detach())}
    grads = full_grads(model)
    for name, param in baseline.named_parameters():
        errors[f"grad:{name}"] = max_rel_error(grads[name], param.grad)
    errors["#grads"] = len(grads)
    errors["copied"] = float(not (torch.equal(mine_ids, ids) and torch.equal(mine_labels, labels)))
    return errors


def test_broadcast_uses_tp_rank_0s_batch_for_loss_and_every_gradient(pools):
    per_rank = pools(2).run(_on_rank_broadcast_batch)
    n_params = len(dict(Transformer(_config()).named_parameters()))
    for rank, errors in enumerate(per_rank):
        assert errors.pop("#grads") == n_params, f"rank {rank}: not every gradient compared"
        assert errors.pop("copied") == 0.0, f"rank {rank}: its batch is not rank 0's"
    assert_errors(per_rank, MODEL_FP32_TOL, "same_batch='broadcast', rank 1 given another batch")


def _on_rank_2d_batches():
    """2 x 2 grid: DP ranks have different batches (fine), TP peers must agree."""
    mesh = init_mesh_2d(dp_size=2, tp_size=2)  # DeviceMesh groups cannot be freed: kept
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = guard(Transformer(_config(), tp_group=mesh["tp"].get_group()))
    ids, labels = _batch(dp_rank)  # one batch per DP rank, the same on its TP peers
    loss = model(ids, labels).item()
    peers_differ = _batch(dp_rank + 2 * tp_rank)  # TP rank 1 gets another batch
    messages = value_error_messages({"tp peers differ": lambda: model(*peers_differ)})
    return loss, messages["tp peers differ"]


def test_2d_each_dp_rank_has_its_batch_but_tp_peers_must_agree(pools):
    per_rank = pools(4).run(_on_rank_2d_batches)
    losses = [loss for loss, _ in per_rank]
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2], losses
    for rank, (_, message) in enumerate(per_rank):
        assert message and "different input_ids" in message, f"rank {rank}: {message!r}"
