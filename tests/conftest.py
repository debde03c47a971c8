import pytest

from tests.mp import WorkerPool

_POOLS = {}


def _pool(world):
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = WorkerPool(world)
    return pool


@pytest.fixture(scope="session")
def pools():
    """Callable world_size -> WorkerPool (spawned once per size, reused across cases)."""
    yield _pool
    for p in _POOLS.values():       # every pool's workers wind down together
        p.stop()
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
