"""Ranks that disagree fail loudly: a model built differently on one rank raises on every rank
within seconds, naming the field and each rank's value, at the cost of one tiny collective."""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tensor_parallel_toy import (ColumnParallelLinear, ModelConfig, RowParallelLinear,
                                 Transformer, VocabParallelEmbedding)
from tensor_parallel_toy.agreement import check_ranks_agree, module_fingerprint
from tensor_parallel_toy.comm import recording
from tensor_parallel_toy.tests.helpers import value_error_messages, world

RAISE_WITHIN_S = 10


def _config(hidden=32):
    return ModelConfig(vocab_size=64, hidden_size=hidden, num_layers=1, num_heads=4,
                       ffn_hidden_size=64, max_seq_len=16)


class _Counter:
    """A recording that counts the transfers and their bytes (see comm.recording)."""

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
        "hidden": lambda: Transformer(_config(64 if one else 32), tp_group=group),
        "overlap": lambda: Transformer(_config(), tp_group=group, overlap=one),
        "seed": lambda: Transformer(_config(), tp_group=group, seed=rank),
        "column dtype": lambda: ColumnParallelLinear(
            8, 16, tp_group=group, dtype=torch.bfloat16 if one else torch.float32),
        "row bias": lambda: RowParallelLinear(16, 8, tp_group=group, bias=one),
        "embedding": lambda: VocabParallelEmbedding(64, 12 if one else 8, tp_group=group),
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
        "hidden": ["Transformers", "hidden_size: 32 on rank 0, 64 on rank 1", "more)"],
        "overlap": ["overlap: False on rank 0, True on rank 1"],
        "seed": ["seed: 0 on rank 0, 1 on rank 1"],
        "column dtype": ["ColumnParallelLinears", "weight: [8, 8] float32 on rank 0, "
                                                  "[8, 8] bfloat16 on rank 1"],
        "row bias": ["RowParallelLinears", "bias: <absent> on rank 0, [8] float32 on rank 1"],
        "embedding": ["VocabParallelEmbeddings", "embedding_dim: 8 on rank 0, 12 on rank 1"],
        "own module": ["blocks", "weight: [4, 4] float32 on rank 0, [6, 4] float32 on rank 1"],
    }
    for rank, messages in enumerate(per_rank):
        for key, words in expected.items():
            message, seconds = messages[key]
            assert message is not None, f"rank {rank}, {key}: no error"
            assert "\n" not in message and all(w in message for w in words), \
                f"rank {rank}, {key}: {message!r}"
            assert seconds < RAISE_WITHIN_S, f"rank {rank}, {key}: raised after {seconds:.1f} s"
    assert per_rank[0] and {k: m for k, (m, _) in per_rank[0].items()} == \
        {k: m for k, (m, _) in per_rank[1].items()}, "the ranks raised different messages"


def _on_rank_construction_transfers():
    """The transfers each construction makes when the ranks agree: {what: [kinds], bytes}."""
    group, _, _ = world()
    built = {}
    for what, build in {
        "Transformer": lambda: Transformer(_config(), tp_group=group, overlap=True),
        "ColumnParallelLinear": lambda: ColumnParallelLinear(8, 16, tp_group=group),
        "RowParallelLinear": lambda: RowParallelLinear(16, 8, tp_group=group, bias=True),
        "VocabParallelEmbedding": lambda: VocabParallelEmbedding(64, 8, tp_group=group),
    }.items():
        with recording(_Counter()) as counter:
            build()
        built[what] = (counter.kinds, counter.bytes)
    dist.barrier()
    return built


def test_building_a_model_or_layer_costs_one_tiny_all_gather(pools):
    """Not one per layer: the Transformer's own layers skip their check, the whole model is
    compared once."""
    for rank, built in enumerate(pools(2).run(_on_rank_construction_transfers)):
        for what, (kinds, nbytes) in built.items():
            assert kinds == ["all-gather"] and nbytes == 8, f"rank {rank}, {what}: {kinds}, " \
                                                           f"{nbytes} bytes"
