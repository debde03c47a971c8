"""Measurement inside a rank: communication, kernel time, memory.

:class:`CommMeter` wraps the ``torch.distributed`` collectives the core uses and counts the
calls, the bytes this rank sends and the time spent in them (calls and waits); it is the one
way the harness, the benchmarks and the tests meter the core's communication.
:func:`time_backend` wraps one backend object's ``forward``/``backward`` (and their packed
forms) to time the kernel calls, and :func:`instrument_core` installs the step hook
(``usp_hal.pipeline.run.HOOKS``) through which the call's own loops report their Ulysses
exchange and ring steps: every path (plain, async, compiled) runs those loops, so every
path's re-layout and ring overhead is timed.
:class:`MemoryMeter` measures the peak memory of a region above what was live at its start
(CPU: the peak of live tensor allocations from the torch profiler's memory events; the
resident-size growth, ``VmHWM`` after a reset through ``/proc/self/clear_refs`` minus
``VmRSS`` at the start, is kept too; accelerators: the platform's peak allocated bytes).
Timed iterations and the memory iteration are separate (the profiler costs time).
"""
from __future__ import annotations

import contextlib
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
            return _wrap_works(res, lambda w: _TimedWork(w, self))
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
    """Seconds and call counts inside a backend's ``forward`` and ``backward`` (packed forms
    included), plus, while the step hook is installed (:func:`instrument_core`), the core's
    own time around them: ``merge_s``, the ring steps minus the kernels and the collectives
    inside them (the out/lse merges, block slices and the rotation's packing), and
    ``layout_s``, the Ulysses exchange steps minus the collectives (packing, unpacking,
    the re-layout copies)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.fwd_s = self.bwd_s = self.merge_s = self.layout_s = 0.0
        self.fwd_calls = self.bwd_calls = 0
        self.work = 0          # attention score entries the kernels computed (causal squares count half)
        self._step: Optional[str] = None       # the step under way (the step hook's state)
        self._marks = (0.0, 0.0, 0.0)          # (wall clock, comm seconds, kernel seconds) at its start

    def step(self, name: Optional[str], comm: Optional["CommMeter"] = None) -> None:
        """The call's loop enters step ``name`` (None: it is done): charge the time since the
        previous step began, less the collectives and kernels inside it, to that step."""
        now = time.perf_counter()
        c = comm.seconds if comm is not None else 0.0
        k = self.fwd_s + self.bwd_s
        if self._step is not None:
            t0, c0, k0 = self._marks
            own = (now - t0) - (c - c0) - (k - k0)
            if self._step == "ring":
                self.merge_s += own
            else:
                self.layout_s += own
        self._step = name
        self._marks = (now, c, k)


# what the core wrappers below report to: set by the rank while it times an iteration
ACTIVE: Dict[str, Any] = {"times": None, "comm": None}


def step_hook(name: Optional[str]) -> None:
    """The hook :func:`instrument_core` installs in the call's loops: reports each step to
    the :class:`KernelTimes` being filled (none: it does nothing)."""
    times = ACTIVE["times"]
    if times is not None:
        times.step(name, ACTIVE["comm"])


def instrument_core() -> list:
    """Time the core's own work around the kernels and collectives: install
    :func:`step_hook` in ``usp_hal.pipeline.run.HOOKS``, which the forward and backward
    loops of every path call as each Ulysses exchange or ring step begins.  Idempotent;
    returns what was installed."""
    from ..pipeline import run as _run
    if step_hook not in _run.HOOKS:
        _run.HOOKS.append(step_hook)
    return ["usp_hal.pipeline.run.HOOKS"]


def uninstrument_core() -> None:
    """Remove the step hook (the loops then pay one ``if`` per step again)."""
    from ..pipeline import run as _run
    while step_hook in _run.HOOKS:
        _run.HOOKS.remove(step_hook)


def _call_of(args, kwargs):
    """The :class:`~usp_hal.dispatch.capabilities.KernelCall` of a backend call (its last argument)."""
    return kwargs.get("call", args[-1] if args else None)


def score_entries(args, kwargs, first: int) -> int:
    """Query-key pairs one kernel call scores: B*H*Sq*Sk, or B*H*S*(S+1)/2 for a causal
    square (the contract only asks for causal on squares).  ``first``: index of q in args."""
    try:
        q, k = args[first], args[first + 1]
        b, sq, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
        sk = int(k.shape[1])
    except (IndexError, AttributeError, TypeError):
        return 0
    if getattr(_call_of(args, kwargs), "causal", False) and sq == sk:
        return b * h * sq * (sq + 1) // 2
    return b * h * sq * sk


def packed_score_entries(args, kwargs, first: int) -> int:
    """Query-key pairs one packed (varlen) call scores: per sequence of its packing,
    H*Sq*Sk, or H*S*(S+1)/2 for a causal square.  ``first``: index of q in args."""
    try:
        h = int(args[first].shape[1])
        call = _call_of(args, kwargs)
        packing = call.packing
        lens = zip(packing.q_lens, packing.k_lens)
    except (IndexError, AttributeError, TypeError):
        return 0
    causal = bool(call.causal)
    return h * sum(nq * (nq + 1) // 2 if causal and nq == nk else nq * nk for nq, nk in lens)


def time_backend(backend, times: KernelTimes, sync: Optional[Callable[[], None]] = None) -> None:
    """Wrap ``backend.forward``/``backward`` and, where the backend has them,
    ``forward_packed``/``backward_packed`` (instance attributes shadow the class methods)
    so each call adds its wall time to ``times``.  ``sync`` (accelerators) is called before
    and after each kernel so its time is the kernel's, at the cost of overlap."""
    if getattr(backend, "_usp_hal_timed", False):
        backend._usp_hal_times = times
        return
    fwd, bwd = backend.forward, backend.backward
    fwd_p, bwd_p = getattr(backend, "forward_packed", None), getattr(backend, "backward_packed", None)

    inside = [0]      # a packed call the backend runs as dense calls is timed once, as itself

    def timed(fn, first: int, field: str, count: str, entries):
        def call(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            kt = backend._usp_hal_times
            kt.work += entries(args, kwargs, first)
            if sync:
                sync()
            inside[0] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync:
                    sync()
                inside[0] -= 1
                setattr(kt, field, getattr(kt, field) + time.perf_counter() - t)
                setattr(kt, count, getattr(kt, count) + 1)
        functools.update_wrapper(call, fn)
        return call

    backend.forward = timed(fwd, 0, "fwd_s", "fwd_calls", score_entries)
    backend.backward = timed(bwd, 1, "bwd_s", "bwd_calls", score_entries)
    if fwd_p is not None:
        backend.forward_packed = timed(fwd_p, 0, "fwd_s", "fwd_calls", packed_score_entries)
    if bwd_p is not None:
        backend.backward_packed = timed(bwd_p, 1, "bwd_s", "bwd_calls", packed_score_entries)
    backend._usp_hal_times = times
    backend._usp_hal_timed = True


TIMED = ("forward", "backward", "forward_packed", "backward_packed")


@contextlib.contextmanager
def untimed(backend):
    """Inside: ``backend`` as it was before :func:`time_backend` (its class's methods, so
    :meth:`~usp_hal.dispatch.backend.AttentionBackend.binds_forward` holds again and a plan may bind
    its call as a user's would); the timers are back afterwards."""
    wrapped = {name: vars(backend).pop(name) for name in TIMED if name in vars(backend)}
    try:
        yield backend
    finally:
        for name, fn in wrapped.items():
            setattr(backend, name, fn)


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


#: how long a measured CPU region lets a collective's worker threads finish after each
#: collective returns (and after each wait), so that the caller, not a worker, frees its buffers
SETTLE_S = 0.003


class _Settled:
    """A Work whose ``wait`` also lets the communication library's workers let go."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        res = self._work.wait(*args, **kwargs)
        time.sleep(SETTLE_S)
        return res

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap_works(res, wrap: Callable):
    """What a ``torch.distributed`` call returned, each Work in it (one, or a list) wrapped."""
    if isinstance(res, list):
        return [wrap(w) if hasattr(w, "wait") else w for w in res]
    if res is not None and hasattr(res, "wait"):
        return wrap(res)
    return res


def _settling(orig):
    def wrapped(*args, **kwargs):
        res = orig(*args, **kwargs)
        if res is None:
            time.sleep(SETTLE_S)     # a synchronous collective: done, its worker about to let go
            return res
        return _wrap_works(res, _Settled)
    functools.update_wrapper(wrapped, orig)
    return wrapped


class MemoryMeter:
    """Peak memory of a region on this process's device, above what was live at its start.

    cpu: the peak of live torch allocations, from the torch profiler's memory events
    (every tensor allocation and free, in order): exact and independent of how malloc
    caches freed memory.  It counts tensors (inputs to collectives and receive buffers
    included), not the communication library's own buffers.  The profiler records the
    frees made on its own thread only, and gloo's worker threads often hold the last
    reference to a collective's send and receive buffers for a moment after the collective
    returns: such a buffer, freed on a worker, stayed "live" in the events to the end of
    the region (a 4 MiB all-to-all eight times in a row read 8 MiB live after all were
    freed; Ring-2 forward+backward at S=4096 read 59.1 MiB where the resident size grew by
    51.1).  So while a region is measured every ``torch.distributed`` collective
    (:data:`CommMeter.NAMES`) pauses :data:`SETTLE_S` after it returns and after each wait
    of its work: the workers let go first and the caller's own free is recorded.  The
    region's time is not meant to be read.  Where the profiler is not
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

    def _settle(self) -> None:
        import torch.distributed as dist
        self._replaced = {}
        for n in CommMeter.NAMES:
            orig = getattr(dist, n, None)
            if orig is not None:
                self._replaced[n] = orig
                setattr(dist, n, _settling(orig))

    def _unsettle(self) -> None:
        import torch.distributed as dist
        for n, orig in getattr(self, "_replaced", {}).items():
            setattr(dist, n, orig)
        self._replaced = {}

    def start(self) -> None:
        from ..dispatch import platform as _platform
        if self.device_type != "cpu":
            _platform.reset_peak_memory(self.device_type)
            acc = _accelerator_allocated()
            self._base = acc or 0
            self.method = "peak allocated - allocated at start" if acc is not None else "peak allocated"
            return
        trim_freed_memory()
        rss = proc_status_kib("VmRSS")
        self._rss_base = rss * 1024 if (rss is not None and reset_peak_rss()) else None
        self._settle()
        try:
            from torch.profiler import ProfilerActivity, profile
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
            self.method = "peak of live tensor allocations (torch profiler memory events)"
        except Exception:               # no profiler: fall back to the resident size
            self._prof = None
            self.method = "VmHWM - VmRSS at start"

    def stop(self) -> int:
        from ..dispatch import platform as _platform
        if self.device_type != "cpu":
            peak = _platform.peak_memory_bytes(self.device_type) or 0
            return max(0, peak - self._base)
        peak_live = None
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            peak_live = _peak_live_bytes(self._prof)
            self._prof = None
        self._unsettle()
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
