"""Rank processes for the harness: a spawned pool, or the ranks of a torchrun job.

:class:`RankPool` spawns N ranks once (clean ``spawn`` start, a free 127.0.0.1 port,
``torch.set_num_threads`` per rank, the device's process-group backend) and runs tasks
``(module, function, kwargs)`` on every rank, each under a deadline.  When a rank fails,
the others get a short grace period to report (the core raises the same error on every
rank), then any rank still stuck in a collective is killed: a bad configuration ends in an
error, never a hang.  A pool of one process without a process group runs the
single-process baselines.  :meth:`RankPool.run_all` is the variant for tests: every rank's
outcome is a result (many cases expect every rank to raise), and only a deadline ends it.
Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) :class:`TorchrunExecutor` runs the
same tasks in this process and gathers every rank's result with :func:`gather_objects`
(no numpy needed).
"""
from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional


class LaunchError(RuntimeError):
    """A spawned run failed: one or more ranks raised, died, or did not finish in time.
    ``tracebacks`` / ``messages``: per failing rank, when the ranks reported them."""

    tracebacks: dict = {}
    messages: dict = {}


def in_torchrun() -> bool:
    """True when this process is one rank of a job started by torchrun (or similar)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure_process(threads: int, device_type: str, local_rank: int):
    """Per-process setup for a rank or a baseline worker; returns the torch.device."""
    import torch

    from ..dispatch import platform as _platform
    # the memory meter's profiler prints start/stop lines at kineto's level 5; read at first use
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    torch.set_num_threads(threads)
    return _platform.set_device(device_type, local_rank)


# ----------------------------------------------------------------------------- spawned pool
def _worker(rank: int, world: int, port: int, threads: int, device_type: str, init_dist: bool,
            init_timeout: float, tasks, results, path):
    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import torch.distributed as dist

        from ..dispatch import platform as _platform
        configure_process(threads, device_type, _local_index(device_type, rank))
        if init_dist:
            dist.init_process_group(_platform.dist_backend_string(device_type), rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=init_timeout))
    except BaseException as exc:
        results.put((rank, "err", f"rank {rank} could not start: {type(exc).__name__}: {exc}",
                     traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                break           # the launcher is gone (killed): do not linger
            continue
        if task is None:
            break
        mod, fn, kwargs = task
        try:
            out = getattr(importlib.import_module(mod), fn)(**kwargs)
            results.put((rank, "ok", out))
        except BaseException as exc:  # report every failure and keep serving
            results.put((rank, "err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    if init_dist:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _local_index(device_type: str, rank: int) -> int:
    if device_type == "cpu":
        return 0
    from ..dispatch import platform as _platform
    n = _platform.device_count(device_type)
    return rank % n if n else 0


class _spawnable_main:
    """``spawn`` children re-import the parent's main module unless told otherwise; the
    ranks only need this package, so hide the main module for the start.  That keeps a
    script without an ``if __name__ == "__main__"`` guard, ``python -`` and ``python -c``
    from breaking (or re-running) in the children."""

    def __enter__(self):
        self._main = sys.modules.get("__main__")
        self._saved = {}
        for attr in ("__file__", "__spec__"):
            if self._main is not None and attr in vars(self._main):
                self._saved[attr] = vars(self._main)[attr]
        if "__file__" in self._saved:
            del self._main.__file__
        if self._saved.get("__spec__") is not None:
            self._main.__spec__ = None
        return self

    def __exit__(self, *exc):
        for attr, val in self._saved.items():
            setattr(self._main, attr, val)


class RankPool:
    """N spawned worker processes that run tasks together (see the module docstring).

    ``init_dist=False`` gives workers without a process group (single-process baselines).
    """

    def __init__(self, world: int, *, threads: int = 1, device_type: str = "cpu", init_dist: bool = True,
                 start_timeout: float = 120.0, grace: float = 10.0, wait: bool = True,
                 pg_timeout: Optional[float] = None):
        self.world, self.threads, self.device_type = world, threads, device_type
        self.init_dist, self.grace = init_dist, grace
        self.procs: list = []
        self._start_timeout = start_timeout
        self._pg_timeout = pg_timeout     # the process group's timeout (default: start_timeout)
        self._ready = False
        self._start(start_timeout)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every worker has started (``wait=False`` lets pools start together)."""
        if not self._ready:
            self._collect("start", self._start_timeout, expect="ready")
            self._ready = True

    def _start(self, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        path = [os.getcwd()] + sys.path
        self.procs = [ctx.Process(target=_worker, name=f"usp-hal-rank{r}",
                                  args=(r, self.world, port, self.threads, self.device_type, self.init_dist,
                                        self._pg_timeout or timeout, self.tasks[r], self.results, path),
                                  daemon=True)
                      for r in range(self.world)]
        with _spawnable_main():
            for p in self.procs:
                p.start()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, timeout: float, **kwargs) -> list:
        """``fn(**kwargs)`` on every rank; returns the per-rank results in rank order.
        Raises LaunchError with every rank's message when any rank fails or time runs out."""
        self.wait_ready()
        if not self.alive():
            raise LaunchError("the worker processes are gone (an earlier task killed the pool)")
        self._submit(fn, kwargs)
        return self._collect(fn.__name__, timeout)

    def run_all(self, fn: Callable, timeout: float, ranks: Optional[list] = None, **kwargs) -> dict:
        """``fn(**kwargs)`` on every rank; {rank: ``("ok", value)`` or ``("err", message,
        traceback)``} for ``ranks`` (default: all; the others may die).  A failing rank is a
        result here, not an error.  A pool whose workers are gone is restarted first.  When
        the ranks have not all reported within ``timeout``, the pool is stopped (ranks may be
        stuck in a collective; the next call restarts it) and TimeoutError is raised."""
        if not self.alive():
            self.restart()
        self.wait_ready()
        self._submit(fn, kwargs)
        want = set(range(self.world)) if ranks is None else set(ranks)
        got: Any = {}
        deadline = time.monotonic() + timeout
        while not want <= set(got):
            try:
                item = self.results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__}{kwargs}: rank(s) {sorted(want - set(got))} did not report within "
                                   f"{timeout} s; the pool was stopped") from None
            got[item[0]] = item[1:]
        return {r: got[r] for r in sorted(want)}

    def restart(self) -> None:
        """Stop the workers and start fresh ones (after a task killed or stopped the pool)."""
        self.close()
        self._ready = False
        self._start(self._start_timeout)
        self.wait_ready()

    def _submit(self, fn: Callable, kwargs: dict) -> None:
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))

    def _collect(self, what: str, timeout: float, expect: str = "ok") -> list:
        got: Any = {}
        errors: Any = {}
        first_error = None
        deadline = time.monotonic() + timeout
        while len(got) + len(errors) < self.world:
            # once a rank failed, the others get a grace period, not the whole deadline
            limit = deadline if first_error is None else min(deadline, first_error + self.grace)
            now = time.monotonic()
            if now >= limit:
                break
            try:
                item = self.results.get(timeout=min(limit - now, 1.0))
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if not p.is_alive() and r not in got and r not in errors:
                        errors[r] = (f"rank {r} exited with code {p.exitcode} without a result", "")
                        first_error = first_error or time.monotonic()
                continue
            rank, status = item[0], item[1]
            if status == expect:
                got[rank] = item[2]
            else:
                errors[rank] = (item[2], item[3] if len(item) > 3 else "")
                first_error = first_error or time.monotonic()
        if errors or len(got) < self.world:
            missing = [r for r in range(self.world) if r not in got and r not in errors]
            self.close()
            lines = []
            by_msg: Any = {}
            for r in sorted(errors):
                by_msg.setdefault(errors[r][0], []).append(r)
            for msg, ranks in by_msg.items():
                who = "every rank" if len(ranks) == self.world > 1 else \
                    ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
                lines.append(f"{who}: {msg}")
            if missing:
                why = "did not finish within the grace period after another rank failed" if errors else \
                    f"did not finish within {timeout:.0f} s (raise --timeout for long runs)"
                lines.append(f"rank(s) {', '.join(map(str, missing))} {why}; the processes were stopped")
            err = LaunchError(f"{what} failed on {len(errors) + len(missing)} of {self.world} rank(s):\n  "
                              + "\n  ".join(lines))
            err.tracebacks = {r: tb for r, (_, tb) in errors.items()}
            err.messages = {r: m for r, (m, _) in errors.items()}
            raise err
        return [got[r] for r in range(self.world)]

    def stop(self) -> None:
        """Tell every worker to finish (without waiting: :meth:`close` waits), so that several
        pools wind down at once."""
        for q in getattr(self, "tasks", []):
            try:
                q.put(None)
            except Exception:
                pass

    def close(self) -> None:
        self.stop()
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TorchrunExecutor:
    """Runs tasks in this process (one rank of a torchrun job) and gathers every rank's result."""

    def __init__(self, threads: int, device_type: str):
        import torch.distributed as dist

        from ..dispatch import platform as _platform
        self.world = int(os.environ["WORLD_SIZE"])
        self.rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        configure_process(threads, device_type, _local_index(device_type, local) if device_type != "cpu" else 0)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(_platform.dist_backend_string(device_type))

    def run(self, fn: Callable, timeout: float, **kwargs) -> list:
        return gather_objects(fn(**kwargs))

    def close(self, ok: bool = True) -> None:
        """Tear the ranks down together: wait for every rank, then destroy the process
        groups, so no rank exits with the communication threads still running (which
        aborts the process with "terminate called without an active exception")."""
        import torch.distributed as dist
        if not (self._owns_group and dist.is_initialized()):
            return
        try:
            if ok:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank of ``group``: like
    ``torch.distributed.all_gather_object``, but without numpy (bytes through tensors)."""
    import pickle

    from ..parallel.comm import all_gather_bytes
    return [pickle.loads(b) if b else None for b in all_gather_bytes(pickle.dumps(obj), group)]
