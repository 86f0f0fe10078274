"""pytest fixtures: one pool of worker processes per (backend, world size), reused by every test.

Spawning a rank costs seconds (each imports torch), so the suite pays it once per world size,
not once per test. A pool that lost a rank (a worker error kills it) is replaced on next use.
"""
import pytest

from tensor_parallel_toy.launcher.initialize import WorkerPool, gpu_count, nccl_rank_capacity


@pytest.fixture(scope="session")
def pools():
    live = {}

    def get(world_size, backend="gloo"):
        key = (backend, world_size)
        if key not in live or not live[key].alive:
            if backend == "nccl" and nccl_rank_capacity() < world_size:
                pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs, "
                            f"found {gpu_count()}")
            live[key] = WorkerPool(world_size, backend=backend)
        return live[key]

    yield get
    for pool in live.values():
        pool.close()
