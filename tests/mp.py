"""Run functions on N real gloo ranks (127.0.0.1), with workers reused across cases.

The workers are the harness's rank pool (:class:`usp_hal.harness.RankPool`): N processes
spawned once, each with a gloo process group, running tasks ``(module, function, kwargs)``.
Tests differ from the CLI in one way: a rank's exception is a result to inspect (many cases
expect every rank to raise), so they use :meth:`RankPool.run_all`, which keeps serving after
errors.  Only a case that hangs stops the pool (it is restarted for the next case) and fails
with TimeoutError, so a hang can never stall the suite.
"""
from __future__ import annotations

import contextlib
import os

from usp_hal.harness import RankPool


@contextlib.contextmanager
def environ(values: dict):
    """Environment variables set for the block, restored afterwards (spawned workers inherit them)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RankError(AssertionError):
    pass


class WorkerPool(RankPool):
    def __init__(self, world: int, pg_timeout=None):
        super().__init__(world, threads=1, pg_timeout=pg_timeout)

    def run_all(self, fn, timeout: float = 60.0, **kwargs) -> list:
        """Run ``fn(**kwargs)`` on every rank; returns per-rank tuples ("ok", value) or
        ("err", message, traceback).  Raises TimeoutError (and restarts later) on a hang."""
        res = super().run_all(fn, timeout, **kwargs)
        return [res[r] for r in range(self.world)]

    def run(self, fn, timeout: float = 60.0, **kwargs) -> list:
        """Like run_all, but any rank's error fails the case with every rank's traceback."""
        res = self.run_all(fn, timeout=timeout, **kwargs)
        errs = [(r, x) for r, x in enumerate(res) if x[0] != "ok"]
        if errs:
            raise RankError("\n".join(f"--- rank {r}: {x[1]}\n{x[2]}" for r, x in errs))
        return [x[1] for x in res]

    def run_expect(self, fn, ranks, timeout: float = 60.0, **kwargs) -> dict:
        """Run ``fn(**kwargs)`` on every rank but collect only ``ranks`` (others may die);
        returns {rank: ("ok", value) | ("err", message, traceback)}.  The pool is closed
        afterwards (ranks may be dead or stuck): use a dedicated pool."""
        try:
            return RankPool.run_all(self, fn, timeout, ranks=ranks, **kwargs)
        finally:
            self.close()


def process_groups() -> int:
    """How many process groups this rank holds (run on a pool's ranks)."""
    import torch.distributed as dist
    return len(dist.distributed_c10d._world.pg_map)
