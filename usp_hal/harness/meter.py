"""Measurement inside a rank: communication, kernel time, memory.

:class:`CommMeter` wraps the ``torch.distributed`` collectives the core uses and counts the
calls, the bytes this rank sends and the time spent in them (calls and waits); it is the one
way the harness, the benchmarks and the tests meter the core's communication.
:func:`time_backend` wraps one backend object's ``forward``/``backward`` to time the kernel
calls, and :func:`instrument_core` times the core's merge and Ulysses re-layout.
:class:`MemoryMeter` measures the peak memory of a region above what was live at its start
(CPU: the peak of live tensor allocations from the torch profiler's memory events; the
resident-size growth, ``VmHWM`` after a reset through ``/proc/self/clear_refs`` minus
``VmRSS`` at the start, is kept too; accelerators: the platform's peak allocated bytes).
Timed iterations and the memory iteration are separate (the profiler costs time).
"""
from __future__ import annotations

import ctypes
import functools
import re
import time
from typing import Any, Callable, Dict, Optional


def trim_freed_memory() -> bool:
    """Give the memory malloc keeps from freed blocks back to the system (glibc
    ``malloc_trim(0)``), so the resident size is the live memory.  False where unavailable."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


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
    ``broadcast`` (when asked for) - the tensor times (group size - 1) on the source rank.
    The core's small per-call metadata exchange (int64 all-gathers) is counted apart, in
    ``metadata_bytes``; coded payloads (fp8 sent as bytes) are data.  Time: the calls
    themselves plus the ``wait()`` of the work objects they return.  ``groups``: the
    ``group`` argument of each call, in order, per name.

    ``names``: the ``torch.distributed`` functions to meter (default :data:`NAMES`, what the
    core calls).  Usable as a context manager; ``reset`` starts a new count.
    """

    NAMES = ("all_to_all_single", "batch_isend_irecv", "all_gather", "all_gather_into_tensor", "all_gather_single")

    def __init__(self, names: Optional[tuple] = None):
        self.names = tuple(self.NAMES if names is None else names)
        self.bytes = {n: 0 for n in self.names}
        self.calls = {n: 0 for n in self.names}
        self.groups: Dict[str, list] = {n: [] for n in self.names}
        self.metadata_bytes = 0        # integer tensors: the core's per-call metadata exchange
        self.seconds = 0.0
        self._orig: Dict[str, Any] = {}

    def reset(self) -> None:
        for n in self.names:
            self.bytes[n] = 0
            self.calls[n] = 0
            self.groups[n] = []
        self.metadata_bytes = 0
        self.seconds = 0.0

    def _sent(self, name, args, kwargs) -> int:
        import torch.distributed as dist
        if name == "broadcast":
            tensor = args[0] if args else kwargs["tensor"]
            src = args[1] if len(args) > 1 else kwargs.get("src")
            n = dist.get_world_size(kwargs.get("group"))
            return _nbytes(tensor) * (n - 1) if dist.get_rank() == src else 0
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
            self.groups[name].append(kwargs.get("group"))
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
        functools.update_wrapper(wrapped, orig)
        return wrapped

    def install(self) -> "CommMeter":
        import torch.distributed as dist
        ACTIVE["comm"] = self
        for n in self.names:
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
ACTIVE: Dict[str, Any] = {"times": None, "comm": None}


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
    functools.update_wrapper(wrapped, fn)
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


def proc_status_kib(field: str) -> Optional[int]:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident size (``/proc/self/clear_refs``); False where unavailable."""
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
        self.method: Optional[str] = None
        self._base = 0
        self._prof: Any = None

    def start(self) -> None:
        from .. import platform as _platform
        if self.device_type != "cpu":
            _platform.reset_peak_memory(self.device_type)
            acc = _accelerator_allocated()
            self._base = acc or 0
            self.method = "peak allocated - allocated at start" if acc is not None else "peak allocated"
            return
        trim_freed_memory()
        rss = proc_status_kib("VmRSS")
        self._rss_base = rss * 1024 if (rss is not None and reset_peak_rss()) else None
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
            return max(0, (proc_status_kib("VmHWM") or 0) * 1024 - self._rss_base)
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
