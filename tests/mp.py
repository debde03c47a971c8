"""Run functions on N real gloo ranks (127.0.0.1), with workers reused across cases.

The workers are the CLI's rank pool (``usp_hal.cli._launch.RankPool``): N processes spawned
once, each with a gloo process group, running tasks ``(module, function, kwargs)``.  Tests
differ from the CLI in one way: a rank's exception is a result to inspect (many cases
expect every rank to raise), so the pool keeps serving after errors.  Only a case that
hangs kills the pool (it is rebuilt for the next case) and fails with TimeoutError, so a
hang can never stall the suite.
"""
from __future__ import annotations

import queue
import time

from usp_hal.cli._launch import RankPool


class RankError(AssertionError):
    pass


class WorkerPool(RankPool):
    def __init__(self, world: int, pg_timeout=None):
        super().__init__(world, threads=1, pg_timeout=pg_timeout)

    def run_all(self, fn, timeout: float = 60.0, **kwargs) -> list:
        """Run ``fn(**kwargs)`` on every rank; returns per-rank tuples ("ok", value) or
        ("err", message, traceback).  Raises TimeoutError (and rebuilds) on a hang."""
        if not self.alive():
            self.close()
            self._start(self._start_timeout)
            self._ready = False
        self.wait_ready()
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        got = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                item = self.results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__}{kwargs} did not finish on all {self.world} ranks within "
                                   f"{timeout}s (finished: {sorted(got)}); the pool was restarted") from None
            got[item[0]] = item[1:]
        return [got[r] for r in range(self.world)]

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
        self.wait_ready()
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        got = {}
        deadline = time.monotonic() + timeout
        try:
            while not set(ranks) <= set(got):
                try:
                    item = self.results.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    raise TimeoutError(f"{fn.__name__}{kwargs}: ranks {sorted(set(ranks) - set(got))} did not "
                                       f"report within {timeout}s") from None
                got[item[0]] = item[1:]
        finally:
            self.close()
        return {r: got[r] for r in ranks}
