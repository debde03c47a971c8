"""Pools of rank processes that run the real Triton kernels under the interpreter.

The variables of :data:`usp_hal.backends.interpret.ENV` must be in a process before its first
``import triton`` (and ``FLASH_ATTENTION_TRITON_AMD_ENABLE`` before ``import flash_attn``),
and they change what the fa2 adapter declares, so they are given to these pools' spawned
processes only: the pytest process and the suite's shared pools never see them.
"""

import pytest

from tests.mp import WorkerPool, environ
from usp_hal.backends.interpret import ENV


class InterpretedPool(WorkerPool):
    """A WorkerPool whose processes start with the interpreter's variables (restarts too)."""

    def _start(self, timeout: float) -> None:
        with environ(ENV):
            super()._start(timeout)


_POOLS: dict = {}


@pytest.fixture(scope="session")
def interpreted():
    """Callable world_size -> InterpretedPool (spawned once per size for the session)."""
    def get(world):
        pool = _POOLS.get(world)
        if pool is None:
            pool = _POOLS[world] = InterpretedPool(world)
        return pool
    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
