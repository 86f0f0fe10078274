"""The ring's schedule: each transfer is posted before the GEMM it hides under, and waited for
after it (ring.py), checked on one process with a ring that records instead of sending.
"""
import pytest
import torch

from tensor_parallel_toy.ring import ring_all_gather, ring_reduce_scatter


class _RecordingRing:
    """Stands in for comm.Ring on one rank and records the order of posts, waits and GEMMs."""

    def __init__(self, size, rank, log):
        self.size, self.rank, self.log = size, rank, log

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
