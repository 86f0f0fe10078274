"""The launcher never leaves a rank hanging, never collides on a port, and runs reproducibly.

These tests kill or break their own pools, so they do not use the shared `pools` fixture.
"""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tensor_parallel_toy.initialize import WorkerError, WorkerPool, choose_backend

STOP_WITHIN_S = 30


def _on_rank_fail_while_peers_wait(how):
    """Rank 1 fails; every other rank is already blocked in a collective rank 1 never joins."""
    if dist.get_rank() == 1:
        time.sleep(0.5)  # let the others enter the all-reduce first
        if how == "raise":
            raise RuntimeError("boom on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_failing_rank_stops_all_ranks_and_is_named(how):
    pool = WorkerPool(3)
    procs = list(pool._procs)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(_on_rank_fail_while_peers_wait, how)
    elapsed = time.monotonic() - start
    assert elapsed < STOP_WITHIN_S, f"took {elapsed:.1f} s to notice and stop the ranks"
    message = str(info.value)
    assert "rank 1" in message, message
    if how == "raise":
        assert "boom on purpose" in message, message
    else:
        assert "died" in message and "-9" in message, message
    for proc in procs:
        proc.join(timeout=5)
    alive = [p.name for p in procs if p.is_alive()]
    assert not alive, f"ranks still running after the failure: {alive}"
    assert not pool.alive


def _on_rank_train(steps):
    """A few steps of the TP model on fixed data; returns the losses as exact bit patterns."""
    from tensor_parallel_toy import ModelConfig, Transformer

    config = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                         ffn_hidden_size=32, max_seq_len=8)
    model = Transformer(config, tp_group=dist.group.WORLD, overlap=True, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (2, 8), generator=gen)
    losses = []
    for _ in range(steps):
        loss = model.loss(ids, ids.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return losses, dist.get_world_size()


def test_two_runs_at_once_pick_their_own_ports_and_give_bitwise_identical_losses():
    first, second = WorkerPool(2), WorkerPool(2)  # both alive at the same time
    try:
        assert first._store.port != second._store.port
        a, b = first.run(_on_rank_train, 4), second.run(_on_rank_train, 4)
    finally:
        first.close(), second.close()
    assert a[0][1] == b[0][1] == 2
    losses_a, losses_b = [r[0] for r in a], [r[0] for r in b]
    assert all(l == losses_a[0] for l in losses_a), f"ranks disagree: {losses_a}"
    assert losses_a == losses_b, f"run 1: {losses_a[0]}\nrun 2: {losses_b[0]}"
    assert len(set(losses_a[0])) > 1, "the loss did not change: the test would prove nothing"


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=0), ["world size 0", "positive"]),
    (dict(world_size=2, backend="mpi"), ["backend 'mpi'", "gloo, nccl"]),
])
def test_bad_launcher_arguments_fail_before_spawning(kwargs, words):
    with pytest.raises(ValueError) as info:
        WorkerPool(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_device_requests_are_refused_with_what_is_valid():
    with pytest.raises(ValueError, match="device 'tpu' is not one of: auto, cpu, cuda"):
        choose_backend(2, "tpu")
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            choose_backend(2, "cuda")
    gpus = torch.cuda.device_count()
    if gpus:
        with pytest.raises(ValueError, match=f"found {gpus}"):
            choose_backend(gpus + 1, "cuda")
    assert choose_backend(64, "auto") == ("gloo" if gpus < 64 else "nccl")
