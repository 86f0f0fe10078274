"""The ring keeps its buffers' contract, and the overlapped layers' check fails when it does not.

A posted transfer may move its bytes at any moment between its post and its `wait()`: at once,
or only when waited for (on NCCL its kernel runs whenever NCCL's stream gets to it). A ring
that reads a receive buffer, or writes a send buffer, before the wait is right only when the
timing favours it, so the plain layer tests (test_parallel_linear.py) can pass with such a
bug, on gloo as on NCCL; and the CUDA stream sanitizer cannot see NCCL's stream (gpu_check.py).

Here each transfer is made to land at one of the two extremes, deterministically, by a stand-in
for `Ring.shift` inside the worker ranks: "at_post" moves the bytes before `shift` returns,
"at_wait" only inside `wait()`; "real" leaves the backend alone. The overlapped column and row
layers must match F.linear every way; and three broken rings, put in place of ring.py's
functions inside the workers, must make that same check fail:
- "wait_dropped": the all-gather never waits, so it consumes a chunk that has not arrived;
- "send_rewritten": the reduce-scatter writes its next partial sum into the accumulator it is
  still sending (a buffer written again before its transfer's wait);
- "one_spare": the all-gather keeps one spare buffer, so from step 2 on it receives into the
  chunk it is still sending and consuming (why ring.py keeps two).
Each is caught at the extreme that exposes it. At the other it may pass; on real timing it may
pass, fail or hang (on gloo, a dropped wait leaves a later transfer waiting for its peer).
"""
import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from tensor_parallel_toy import ColumnParallelLinear, RowParallelLinear, ring
from tensor_parallel_toy.launcher.initialize import current_device
from tensor_parallel_toy.ring import Ring

from .helpers import BACKENDS, FP32_TOL, assert_errors, max_rel_error, world


# ----------------------------------------------------------------------------------------------
# Worker side: when the bytes land, and rings that break the contract
# ----------------------------------------------------------------------------------------------
class _Done:
    def wait(self):
        pass


def _landing_at_post(shift):
    def at_post(ring, send, recv):
        shift(ring, send, recv).wait()
        return _Done()
    return at_post


def _landing_at_wait(shift):
    def at_wait(ring, send, recv):
        class Later:
            def wait(self):
                shift(ring, send, recv).wait()
        return Later()
    return at_wait


LANDINGS = {"real": None, "at_post": _landing_at_post, "at_wait": _landing_at_wait}


def _all_gather_wait_dropped(shard, shard_consumer, ring):
    """ring.ring_all_gather without its wait()."""
    p, r = ring.size, ring.rank
    current = shard.contiguous()
    spare = [current.new_zeros(current.shape) for _ in range(2)]
    for k in range(p):
        incoming = spare[k % 2]
        if k < p - 1:
            ring.shift(send=current, recv=incoming)  # the pending step is dropped
        shard_consumer((r - k) % p, current)
        current = incoming


def _reduce_scatter_send_rewritten(chunk_producer, ring):
    """ring.ring_reduce_scatter that writes the next partial into the accumulator in flight."""
    p, r = ring.size, ring.rank
    acc = chunk_producer((r - 1) % p).contiguous()
    incoming = acc.new_zeros(acc.shape)
    for k in range(1, p):
        pending = ring.shift(send=acc, recv=incoming)
        acc.copy_(chunk_producer((r - 1 - k) % p))  # written again before the wait
        pending.wait()
        acc.add_(incoming)
    return acc


def _all_gather_one_spare(shard, shard_consumer, ring):
    """ring.ring_all_gather with one spare buffer instead of two."""
    p, r = ring.size, ring.rank
    current = shard.contiguous()
    spare = current.new_zeros(current.shape)
    for k in range(p):
        pending = ring.shift(send=current, recv=spare) if k < p - 1 else None
        shard_consumer((r - k) % p, current)
        if pending is not None:
            pending.wait()
            current = spare


BROKEN = {"wait_dropped": ("ring_all_gather", _all_gather_wait_dropped),
          "send_rewritten": ("ring_reduce_scatter", _reduce_scatter_send_rewritten),
          "one_spare": ("ring_all_gather", _all_gather_one_spare)}


@contextmanager
def _replaced(patches):
    """Set (owner, name, value) attributes for the block; the pool's ranks live on after it."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _on_rank_overlapped_layer_errors(landing, broken=None, ring_pieces=1):
    """{output or gradient: error} of the overlapped column and row layers against F.linear in
    fp64 on the full tensors, with the transfers landing as `landing` says and, if `broken`
    names one, that broken ring in place of ring.py's function. `ring_pieces=2`: the ring in two
    pieces per chunk, whose buffers are reused piece by piece."""
    group, p, r = world()
    patches = [] if LANDINGS[landing] is None else [
        (Ring, "shift", LANDINGS[landing](Ring.shift))]
    if broken:
        patches.append((ring, *BROKEN[broken]))
    gen = torch.Generator().manual_seed(31)
    s, b, n = 4 * p, 2, 6 * p  # every rank's sequence chunk and feature slice non-empty
    x, dy = torch.randn(s, b, n, generator=gen), torch.randn(s, b, n, generator=gen)
    w = torch.randn(n, n, generator=gen) / math.sqrt(n)
    seq = lambda t: t.chunk(p, dim=0)[r]  # noqa: E731  this rank's sequence rows
    feat = lambda t, d=-1: t.chunk(p, dim=d)[r]  # noqa: E731  this rank's feature slice
    errors, dev = {}, current_device()
    with _replaced(patches):
        for kind, cls in (("column", ColumnParallelLinear), ("row", RowParallelLinear)):
            ref = {"x": x.double().requires_grad_(), "w": w.double().requires_grad_()}
            y_ref = F.linear(ref["x"], ref["w"])
            y_ref.backward(dy.double())
            layer = cls(n, n, tp_group=group, bias=False, overlap=True,
                        ring_pieces=ring_pieces, device=dev)
            x_in, dy_in, w_in, pick = ((seq(x), feat(dy), feat(w, 0), (feat, seq, 0))
                                       if kind == "column" else
                                       (feat(x), seq(dy), feat(w, 1), (seq, feat, 1)))
            with torch.no_grad():
                layer.weight.copy_(w_in)
            x_in = x_in.to(dev).requires_grad_()
            y = layer(x_in)
            y.backward(dy_in.to(dev))
            of_y, of_x, w_dim = pick
            errors[f"{kind} y"] = max_rel_error(y, of_y(y_ref.detach()))
            errors[f"{kind} dx"] = max_rel_error(x_in.grad, of_x(ref["x"].grad))
            errors[f"{kind} dw"] = max_rel_error(layer.weight.grad, feat(ref["w"].grad, w_dim))
    return errors


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ring_pieces", [1, 2], ids=["ring", "pieces2"])
@pytest.mark.parametrize("landing", list(LANDINGS))
@pytest.mark.parametrize("tp", [2, 3], ids=["tp2", "tp3"])
def test_overlapped_layers_match_plain_pytorch_however_the_ring_transfers_land(pools, tp, landing,
                                                                               ring_pieces, backend):
    assert_errors(pools(tp, backend).run(_on_rank_overlapped_layer_errors, landing, None,
                                         ring_pieces), FP32_TOL,
                  f"overlapped layers, tp={tp}, ring_pieces={ring_pieces}, transfers landing "
                  f"{landing}, {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("broken, tp, landing", [
    pytest.param("wait_dropped", 2, "at_wait", id="wait_dropped-tp2-at_wait"),
    pytest.param("send_rewritten", 2, "at_wait", id="send_rewritten-tp2-at_wait"),
    pytest.param("one_spare", 3, "at_post", id="one_spare-tp3-at_post"),
])
def test_the_overlapped_layer_check_fails_for_a_ring_that_breaks_its_buffer_contract(
        pools, broken, tp, landing, backend):
    per_rank = pools(tp, backend).run(_on_rank_overlapped_layer_errors, landing, broken)
    with pytest.raises(AssertionError) as caught:
        assert_errors(per_rank, FP32_TOL, f"broken ring {broken}")
    # Wrong chunks, not round-off: a tolerance tweak could never hide this bug.
    worst = max(max(errors.values()) for errors in per_rank)
    assert not worst <= 1e-2, f"broken ring {broken}: worst error only {worst:.3g}"
    assert "above tolerance" in str(caught.value)
