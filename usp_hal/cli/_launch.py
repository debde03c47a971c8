"""Process and measurement helpers shared by ``usp-hal run`` and ``usp-hal bench``.

Processes
    :class:`RankPool` spawns N ranks once (clean ``spawn`` start, a free 127.0.0.1 port,
    ``torch.set_num_threads`` per rank, the device's process-group backend) and runs tasks
    ``(module, function, kwargs)`` on every rank, each under a deadline.  When a rank
    fails, the others get a short grace period to report (the core raises the same error
    on every rank), then any rank still stuck in a collective is killed: a bad
    configuration ends in an error, never a hang.  A pool of one process without a
    process group runs the single-process baselines.  Under ``torchrun`` (``RANK`` and
    ``WORLD_SIZE`` set) :class:`TorchrunExecutor` runs the same tasks in this process and
    gathers every rank's result with :func:`gather_objects` (no numpy needed).

Measurement (inside a rank)
    :class:`CommMeter` wraps the ``torch.distributed`` collectives the core uses and counts
    the bytes this rank sends and the time spent in them (calls and waits);
    :func:`time_backend` wraps one backend object's ``forward``/``backward`` to time the
    kernel calls; :class:`MemoryMeter` measures the peak memory of a region above what was
    live at its start (CPU: the peak of live tensor allocations from the torch profiler's
    memory events; the resident-size growth, ``VmHWM`` after a reset through
    ``/proc/self/clear_refs`` minus ``VmRSS`` at the start, is kept too; accelerators: the
    platform's peak allocated bytes).  Timed iterations and the memory iteration are
    separate (the profiler costs time).
"""
from __future__ import annotations

import ctypes
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import re
import socket
import sys
import time
import traceback
from typing import Callable, List, Optional

class LaunchError(RuntimeError):
    """A spawned run failed: one or more ranks raised, died, or did not finish in time."""


def in_torchrun() -> bool:
    """True when this process is one rank of a job started by torchrun (or similar)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trim_freed_memory() -> bool:
    """Give the memory malloc keeps from freed blocks back to the system (glibc
    ``malloc_trim(0)``), so the resident size is the live memory.  False where unavailable."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def configure_process(threads: int, device_type: str, local_rank: int):
    """Per-process setup for a rank or a baseline worker; returns the torch.device."""
    import torch

    from .. import platform as _platform
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

        from .. import platform as _platform
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
    from .. import platform as _platform
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
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        return self._collect(fn.__name__, timeout)

    def _collect(self, what: str, timeout: float, expect: str = "ok") -> list:
        got, errors = {}, {}
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
            by_msg = {}
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

    def close(self) -> None:
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TorchrunExecutor:
    """Runs tasks in this process (one rank of a torchrun job) and gathers every rank's result."""

    def __init__(self, threads: int, device_type: str):
        import torch.distributed as dist

        from .. import platform as _platform
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

    from ..comm import all_gather_bytes
    return [pickle.loads(b) if b else None for b in all_gather_bytes(pickle.dumps(obj), group)]


def _nbytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


class _TimedWork:
    """A torch.distributed Work whose ``wait`` time is added to a meter."""

    def __init__(self, work, meter: "CommMeter"):
        self._work, self._meter = work, meter

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._meter.seconds += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._work, name)


def _is_integer_payload(name, args, kwargs) -> bool:
    """The core's per-call metadata exchange: an all-gather of int64 values.  Everything
    else (all-to-alls, p2p, all-gathers of data, coded payloads sent as bytes) is data."""
    if not name.startswith("all_gather"):
        return False
    t = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input", kwargs.get("input_tensor")))
    import torch
    return t is not None and getattr(t, "dtype", None) == torch.int64


class CommMeter:
    """Counts bytes sent by this rank and time spent in collectives while installed.

    Bytes sent: ``all_to_all_single`` - the input minus the chunk this rank keeps;
    ``batch_isend_irecv`` - the tensors of its isend ops; ``all_gather`` /
    ``all_gather_into_tensor`` / ``all_gather_single`` - the input times (group size - 1)
    (every peer needs it).
    The core's small per-call metadata exchange (int64 all-gathers) is counted apart, in
    ``metadata_bytes``; coded payloads (fp8 sent as bytes) are data.  Time: the calls themselves plus the ``wait()`` of the work
    objects they return.
    """

    NAMES = ("all_to_all_single", "batch_isend_irecv", "all_gather", "all_gather_into_tensor", "all_gather_single")

    def __init__(self):
        self.bytes = {n: 0 for n in self.NAMES}
        self.calls = {n: 0 for n in self.NAMES}
        self.metadata_bytes = 0        # integer tensors: the core's per-call metadata exchange
        self.seconds = 0.0
        self._orig = {}

    def reset(self) -> None:
        for n in self.NAMES:
            self.bytes[n] = 0
            self.calls[n] = 0
        self.metadata_bytes = 0
        self.seconds = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def _sent(self, name, args, kwargs) -> int:
        import torch.distributed as dist
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            return sum(_nbytes(op.tensor) for op in ops if op.op in (dist.isend, dist.send))
        group = kwargs.get("group")
        n = dist.get_world_size(group)
        if name == "all_to_all_single":
            inp = args[1] if len(args) > 1 else kwargs["input"]
            splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            me = dist.get_rank(group)
            if splits:
                per_row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else _nbytes(inp)
                return _nbytes(inp) - int(splits[me]) * per_row
            return _nbytes(inp) - _nbytes(inp) // n
        tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
        return _nbytes(tensor) * (n - 1)

    def _wrap(self, name, orig):
        def wrapped(*args, **kwargs):
            self.calls[name] += 1
            sent = self._sent(name, args, kwargs)
            if _is_integer_payload(name, args, kwargs):
                self.metadata_bytes += sent
            else:
                self.bytes[name] += sent
            t = time.perf_counter()
            try:
                res = orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
            if isinstance(res, list):
                return [_TimedWork(w, self) for w in res]
            if res is not None and hasattr(res, "wait"):
                return _TimedWork(res, self)
            return res
        wrapped.__wrapped__ = orig
        return wrapped

    def install(self) -> "CommMeter":
        import torch.distributed as dist
        ACTIVE["comm"] = self
        for n in self.NAMES:
            orig = getattr(dist, n, None)
            if orig is not None:
                self._orig[n] = orig
                setattr(dist, n, self._wrap(n, orig))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist
        ACTIVE["comm"] = None
        for n, orig in self._orig.items():
            setattr(dist, n, orig)
        self._orig.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()


class KernelTimes:
    """Seconds and call counts inside a backend's ``forward`` and ``backward``, plus the
    core's merge (``merge_s``) and Ulysses re-layout (``layout_s``: the all-to-all
    wrappers' time minus the collective itself) while :func:`instrument_core` is active."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.fwd_s = self.bwd_s = self.merge_s = self.layout_s = 0.0
        self.fwd_calls = self.bwd_calls = 0
        self.work = 0          # attention score entries the kernels computed (causal squares count half)


# what the core wrappers below report to: set by the rank while it times an iteration
ACTIVE = {"times": None, "comm": None}


def _timed_core_function(fn, field: str, minus_comm: bool):
    def wrapped(*args, **kwargs):
        times, comm = ACTIVE["times"], ACTIVE["comm"]
        if times is None:
            return fn(*args, **kwargs)
        c0 = comm.seconds if (minus_comm and comm is not None) else 0.0
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            if minus_comm and comm is not None:
                dt -= comm.seconds - c0
            setattr(times, field, getattr(times, field) + dt)
    wrapped.__wrapped__ = fn
    return wrapped


def instrument_core() -> list:
    """Time the core's merge and Ulysses re-layout by wrapping what the core calls
    (``usp_hal.ring.merge_block``; the ``UlyssesExchange`` methods, minus the collective
    inside).  Idempotent; returns the names wrapped (missing ones are skipped)."""
    import importlib as _il
    done = []
    for modname, name, field, minus in (("usp_hal.ring", "merge_block", "merge_s", False),
                                        ("usp_hal.ulysses:UlyssesExchange", "qkv_to_heads", "layout_s", True),
                                        ("usp_hal.ulysses:UlyssesExchange", "out_to_seq", "layout_s", True),
                                        ("usp_hal.ulysses:UlyssesExchange", "dout_to_heads", "layout_s", True),
                                        ("usp_hal.ulysses:UlyssesExchange", "grads_to_seq", "layout_s", True)):
        modpath, _, cls = modname.partition(":")
        mod = _il.import_module(modpath)
        if cls:
            mod = getattr(mod, cls)
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        if not getattr(fn, "_usp_hal_instrumented", False):
            w = _timed_core_function(fn, field, minus)
            w._usp_hal_instrumented = True
            setattr(mod, name, w)
        done.append(f"{modname}.{name}")
    return done


def score_entries(args, kwargs, first: int) -> int:
    """Query-key pairs one kernel call scores: B*H*Sq*Sk, or B*H*S*(S+1)/2 for a causal
    square (the contract only asks for causal on squares).  ``first``: index of q in args."""
    try:
        q, k = args[first], args[first + 1]
        b, sq, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
        sk = int(k.shape[1])
    except (IndexError, AttributeError, TypeError):
        return 0
    if kwargs.get("causal") and sq == sk:
        return b * h * sq * (sq + 1) // 2
    return b * h * sq * sk


def time_backend(backend, times: KernelTimes, sync: Optional[Callable[[], None]] = None) -> None:
    """Wrap ``backend.forward``/``backward`` (instance attributes shadow the class methods)
    so each call adds its wall time to ``times``.  ``sync`` (accelerators) is called before
    and after each kernel so its time is the kernel's, at the cost of overlap."""
    if getattr(backend, "_usp_hal_timed", False):
        backend._usp_hal_times = times
        return
    fwd, bwd = backend.forward, backend.backward

    def forward(*args, **kwargs):
        backend._usp_hal_times.work += score_entries(args, kwargs, 0)
        if sync:
            sync()
        t = time.perf_counter()
        try:
            return fwd(*args, **kwargs)
        finally:
            if sync:
                sync()
            backend._usp_hal_times.fwd_s += time.perf_counter() - t
            backend._usp_hal_times.fwd_calls += 1

    def backward(*args, **kwargs):
        backend._usp_hal_times.work += score_entries(args, kwargs, 1)
        if sync:
            sync()
        t = time.perf_counter()
        try:
            return bwd(*args, **kwargs)
        finally:
            if sync:
                sync()
            backend._usp_hal_times.bwd_s += time.perf_counter() - t
            backend._usp_hal_times.bwd_calls += 1

    backend.forward, backend.backward = forward, backward
    backend._usp_hal_times = times
    backend._usp_hal_timed = True


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """Peak memory of a region on this process's device, above what was live at its start.

    cpu: the peak of live torch allocations, from the torch profiler's memory events
    (every tensor allocation and free, in order): exact and independent of how malloc
    caches freed memory.  It counts tensors (inputs to collectives and receive buffers
    included), not the communication library's own buffers.  Where the profiler is not
    available: the growth of the resident size (VmHWM after a reset through
    /proc/self/clear_refs, minus VmRSS at the start, malloc's free memory trimmed first),
    which also sees allocator caching and fragmentation.
    Accelerators: ``platform.peak_memory_bytes`` minus the bytes allocated at the start.
    """

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.method = None
        self._base = 0
        self._prof = None

    def start(self) -> None:
        from .. import platform as _platform
        if self.device_type != "cpu":
            _platform.reset_peak_memory(self.device_type)
            acc = _accelerator_allocated()
            self._base = acc or 0
            self.method = "peak allocated - allocated at start" if acc is not None else "peak allocated"
            return
        trim_freed_memory()
        rss = _status_kib("VmRSS")
        self._rss_base = rss * 1024 if (rss is not None and _reset_hwm()) else None
        try:
            from torch.profiler import ProfilerActivity, profile
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
            self.method = "peak of live tensor allocations (torch profiler memory events)"
        except Exception:               # no profiler: fall back to the resident size
            self._prof = None
            self.method = "VmHWM - VmRSS at start"

    def stop(self) -> int:
        from .. import platform as _platform
        if self.device_type != "cpu":
            peak = _platform.peak_memory_bytes(self.device_type) or 0
            return max(0, peak - self._base)
        peak_live = None
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            peak_live = _peak_live_bytes(self._prof)
            self._prof = None
        if peak_live is None:
            self.method = "VmHWM - VmRSS at start"
            if self._rss_base is None:
                return 0
            return max(0, (_status_kib("VmHWM") or 0) * 1024 - self._rss_base)
        return peak_live


def _peak_live_bytes(prof) -> Optional[int]:
    """Max over time of the running sum of allocation sizes (frees are negative)."""
    try:
        events = prof.profiler.kineto_results.events()
        mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except Exception:
        return None
    cur = peak = 0
    for _, n in mem:
        cur += n
        peak = max(peak, cur)
    return int(peak)


def _accelerator_allocated() -> Optional[int]:
    import torch
    acc = getattr(torch, "accelerator", None)
    fn = getattr(acc, "memory_allocated", None) if acc is not None else None
    if fn is None:
        return None
    try:
        return int(fn())
    except Exception:
        return None


def median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_ms(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f}"
