"""The ring's schedule: each transfer is posted before the GEMM it hides under, and waited for
after it (ring.py), checked on one process with a ring that records instead of sending.
"""
import pytest
import torch

from tensor_parallel_toy.ring import ring_all_gather, ring_reduce_scatter


class _RecordingRing:
    """Stands in for comm.Ring on one rank and records the order of posts, waits and GEMMs."""

    def __init__(self, size, rank, log, pieces=1):
        self.size, self.rank, self.log, self.pieces = size, rank, log, pieces

    def shift(self, send, recv):
        recv.copy_(send)
        self.log.append("post")
        log = self.log

        class Pending:
            def wait(self):
                log.append("wait")
        return Pending()


@pytest.mark.parametrize("p", [2, 4])
def test_ring_posts_next_transfer_before_each_gemm(p):
    log = []
    ring_all_gather(torch.zeros(2, 3), lambda c, chunk: log.append(f"gemm{c}"),
                    _RecordingRing(p, 1, log))
    chunks = [(1 - k) % p for k in range(p)]
    expected = sum((["post", f"gemm{c}", "wait"] for c in chunks[:-1]), []) + [f"gemm{chunks[-1]}"]
    assert log == expected, log

    log.clear()
    ring_reduce_scatter(lambda c: log.append(f"gemm{c}") or torch.zeros(2, 3),
                        _RecordingRing(p, 1, log))
    chunks = [(1 - 1 - k) % p for k in range(p)]
    expected = [f"gemm{chunks[0]}"] + sum((["post", f"gemm{c}", "wait"] for c in chunks[1:]), [])
    assert log == expected, log


@pytest.mark.parametrize("p", [2, 3])
def test_ring_in_pieces_passes_each_piece_on_before_its_gemm_and_waits_only_for_that_piece(p):
    """m pieces per chunk: piece j of a chunk is waited for just before its own GEMM (not the
    whole chunk), and passed on to the next rank before that GEMM runs."""
    m, r, log = 3, 1, []
    ring_all_gather(torch.zeros(6, 3), lambda i, block: log.append(f"gemm{i}"),
                    _RecordingRing(p, r, log, pieces=m))
    expected = []
    for k in range(p):
        for j in range(m):
            expected += (["wait"] if k > 0 else []) + (["post"] if k < p - 1 else [])
            expected.append(f"gemm{(r - k) % p * m + j}")
    assert log == expected, log

    log.clear()
    result = ring_reduce_scatter(lambda i: log.append(f"gemm{i}") or torch.full((2, 3), i),
                                 _RecordingRing(p, r, log, pieces=m))
    expected = []
    for k in range(p):
        for j in range(m):
            expected += [f"gemm{(r - 1 - k) % p * m + j}"] + (["wait"] if k > 0 else []) + \
                (["post"] if k < p - 1 else [])
    assert log == expected, log
    assert result.shape == (2 * m, 3), result.shape  # chunk r: its m pieces
