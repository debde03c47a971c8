"""Communication primitives shared by the Ulysses exchange (``usp_hal.ulysses``) and the
ring rotations (``usp_hal.rotation``): collectives that name themselves when they fail, the
small host-side metadata exchanges, and a stable integer code per dtype.

Every collective the core issues goes through :func:`collective` (or :func:`wait`), so a
timeout or a dead peer surfaces as :class:`CommError` naming the call and the group (for
example ``"Ulysses all-to-all of q/k/v (forward) on the ulysses group, ranks (0, 1)"``),
raised within the group's timeout.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A collective of the core failed (timeout, a peer that died or skipped the call)."""


def group_timeout(group) -> Optional[datetime.timedelta]:
    """The timeout the process group ``group`` (None = WORLD) was created with, if readable."""
    grp: Any = group if group is not None else dist.group.WORLD
    for dev in ("cpu", "cuda", "xpu", "npu"):
        try:
            backend = grp._get_backend(torch.device(dev))
            return backend.options._timeout
        except Exception:
            continue
    return None


def collective(what: str, where: str, fn: Callable, *args, **kwargs):
    """Run one collective; any failure becomes a :class:`CommError` naming ``what`` and ``where``.
    Under ``torch.profiler`` the call is labelled ``usp_hal: <what>`` in the trace (the check
    costs ~40 ns when no profiler runs; the label itself, ~7 us, only while one does)."""
    try:
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(f"usp_hal: {what}"):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    except CommError:
        raise
    except RuntimeError as exc:
        raise CommError(f"{what} on the {where} failed: {exc}") from exc


def wait(what: str, where: str, works) -> None:
    """Wait on the work handle(s) of an asynchronous collective, naming it on failure."""
    if works is None:
        return
    if not isinstance(works, (list, tuple)):
        works = [works]
    for w in works:
        collective(f"wait for {what}", where, w.wait)


# ---------------------------------------------------------------------------------- metadata
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate((
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))) if dt is not None}


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` the same way on every rank (for metadata vectors)."""
    code = _DTYPE_CODES.get(dtype)
    if code is not None:
        return code
    return 1000 + sum(str(dtype).encode())   # any other dtype: stable across processes


def _meta_device(group) -> torch.device:
    """Small host-side exchanges go through gloo when the group has it, else the device."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "undefined":
        return torch.device("cpu")
    from . import platform as _platform
    acc = getattr(torch, "accelerator", None)
    index = acc.current_device_index() if acc is not None else 0
    return torch.device(_platform.torch_device_name(_platform.default_device_type()), index)


def _all_gather_single(*args, **kwargs):
    """``all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor``; looked up at
    call time so wrappers installed on ``torch.distributed`` see it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def all_gather_ints(values: Sequence[int], group=None, *, what: str = "metadata all-gather",
                    where: str = "sequence-parallel group") -> List[List[int]]:
    """Every rank's list of integers (all the same length), in group-rank order."""
    t = torch.tensor(list(values), dtype=torch.long, device=_meta_device(group))
    n = dist.get_world_size(group)
    out = torch.empty(n * t.numel(), dtype=torch.long, device=t.device)
    collective(what, where, _all_gather_single, out, t, group=group)
    return out.view(n, -1).tolist()


def all_gather_bytes(data: bytes, group=None, *, what: str = "message all-gather",
                     where: str = "sequence-parallel group") -> List[bytes]:
    """Every rank's bytes (any lengths), in group-rank order; no pickling and no numpy."""
    sizes = [r[0] for r in all_gather_ints([len(data)], group, what=what, where=where)]
    width = max(sizes)
    if width == 0:
        return [b""] * len(sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(_meta_device(group))
    parts = torch.empty(len(sizes) * width, dtype=torch.uint8, device=buf.device)
    collective(what, where, _all_gather_single, parts, buf, group=group)
    parts = parts.view(len(sizes), width).cpu()
    return [bytes(parts[i, :n].tolist()) for i, n in enumerate(sizes)]


