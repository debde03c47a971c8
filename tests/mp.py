"""Run functions on N real gloo ranks (127.0.0.1), with workers reused across cases.

A :class:`WorkerPool` spawns N processes once; each initialises a gloo process group and
then runs tasks ``(module, function, kwargs)`` from its queue.  ``run`` collects one result
per rank within a deadline; a case that hangs kills the pool (it is rebuilt for the next
case) and fails with TimeoutError, so a hang can never stall the suite.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, path):
    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        mod, fn, kwargs = task
        try:
            out = getattr(importlib.import_module(mod), fn)(**kwargs)
            results.put((rank, "ok", out))
        except BaseException as exc:  # report every failure, keep serving
            results.put((rank, "err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    dist.destroy_process_group()


class RankError(AssertionError):
    pass


class WorkerPool:
    def __init__(self, world: int):
        self.world = world
        self.procs = []
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.tasks[r], self.results,
                                                        [here] + sys.path), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run_all(self, fn, timeout: float = 60.0, **kwargs) -> list:
        """Run ``fn(**kwargs)`` on every rank; returns per-rank tuples ("ok", value) or
        ("err", message, traceback).  Raises TimeoutError (and rebuilds) on a hang."""
        if not self.alive():
            self.close()
            self._start()
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        got = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            left = deadline - time.monotonic()
            try:
                item = self.results.get(timeout=max(left, 0.01))
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

    def close(self):
        for q in getattr(self, "tasks", []):
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self.procs = []
