import time

import pytest

from tests.mp import WorkerPool

_POOLS = {}

# markers a test gets from others (pyproject.toml lists them all): the fast tier, `pytest -m "not slow"`,
# leaves out the model integrations, torch.compile and the real kernels
_SLOW_WITH = ("models", "compile", "real_kernel")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if {"pools", "interpreted"} & set(item.fixturenames) and item.get_closest_marker("multirank") is None:
            item.add_marker(pytest.mark.multirank)        # it runs on gloo ranks, whatever its file says
        if item.get_closest_marker("real_kernel") is not None:
            item.add_marker(pytest.mark.optional_pkg)     # triton and the kernel packages: CI's second tier
        if any(item.get_closest_marker(m) is not None for m in _SLOW_WITH):
            item.add_marker(pytest.mark.slow)


# a worker holds every process group its cases created (each a communicator with its threads:
# three per gloo group); past this many, the pool is replaced after the case, so a long suite
# never schedules hundreds of idle communication threads on two cores
GROUP_LIMIT = 64


_CASES = [0]
END_GRACE = 1.0     # seconds the pools' workers get to exit at the end of the run


def pytest_runtest_teardown(item, nextitem):
    if "pools" not in item.fixturenames:
        return
    _CASES[0] += 1
    if _CASES[0] % 8:                       # asked every 8 cases: a case creates a few groups at most
        return
    from tests.mp import process_groups
    for world, pool in list(_POOLS.items()):
        try:
            held = max(pool.run(process_groups, timeout=30))
        except Exception:   # noqa: BLE001 - a pool that cannot answer is replaced as well
            held = GROUP_LIMIT + 1
        if held > GROUP_LIMIT:
            pool.stop()
            pool.close()
            del _POOLS[world]


def _pool(world):
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = WorkerPool(world)
    return pool


@pytest.fixture(scope="session")
def pools():
    """Callable world_size -> WorkerPool (spawned once per size, reused across cases)."""
    yield _pool
    # every pool's workers are told to finish together and given END_GRACE seconds in all;
    # those still destroying their process groups or leaving the interpreter then are killed
    # (nothing is asked of them any more: waited for pool after pool, that was seconds of
    # every run's end on two cores)
    for p in _POOLS.values():
        p.stop()
    deadline = time.monotonic() + END_GRACE
    for p in _POOLS.values():
        for proc in p.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in _POOLS.values():
        for proc in p.procs:
            if proc.is_alive():
                proc.kill()
        p.close()
    _POOLS.clear()
