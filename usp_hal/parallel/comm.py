"""Communication primitives shared by the Ulysses exchange (``usp_hal.parallel.ulysses``) and the
ring rotations (``usp_hal.parallel.rotation``): collectives that name themselves when they fail, the
small host-side metadata exchanges, a stable integer code per dtype, and :func:`agree`, the
one "flag, gather, raise on every rank" check of every entry point that communicates.

Every collective the core issues goes through :func:`collective` (or :func:`wait`), so a
timeout or a dead peer surfaces as :class:`CommError` naming the call and the group (for
example ``"Ulysses all-to-all of q/k/v (forward) on the ulysses group, ranks (0, 1)"``),
raised within the group's timeout.

:func:`agree` is how an entry point refuses bad arguments without leaving a peer waiting: every
rank validates locally, then every rank (failed or not) joins one small all-gather of ints;
when any rank failed, a second all-gather carries the reasons, and every rank raises the same
:class:`AgreementError` naming each failed rank and its reason.  No rank raises before the
collective, so none waits in it.
"""
from __future__ import annotations

import array
import builtins
import datetime
import functools
import struct
import weakref
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A collective of the core failed (timeout, a peer that died or skipped the call)."""


class OutOfStepError(CommError):
    """The ranks of a group can no longer be trusted to make the same calls in the same
    order, so the library's use of the group has ended on this rank: raised by the call that
    found it (a ``check_ranks="first_call"`` module whose call changed on this rank, or an
    attention call whose data exchange failed), and then by every later call of the library
    on the group on this rank, before it communicates.  Rebuild the process groups (and the
    mesh) to go on."""


#: process groups whose use has ended on this rank (:func:`end_use`) -> why
_ENDED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_ENDED_IDS: Dict[int, str] = {}     # groups that take no weak reference


def end_use(groups: Sequence[Any], reason: str) -> None:
    """End the library's use of ``groups`` on this rank: every later :func:`agree` on one of
    them, and every attention call on a mesh over one of them, raises :class:`OutOfStepError`
    with ``reason`` before any collective."""
    for g in groups:
        if g is None:
            continue
        if ended(g) is not None:
            continue
        try:
            _ENDED[g] = reason
        except TypeError:
            _ENDED_IDS[id(g)] = reason


def any_ended() -> bool:
    """Whether the use of some group ended on this rank (the steady-path test)."""
    return bool(_ENDED or _ENDED_IDS)


def ended(group) -> Optional[str]:
    """Why the use of ``group`` ended on this rank, or None (the usual case, one test of an
    empty dictionary)."""
    if not (_ENDED or _ENDED_IDS) or group is None:
        return None
    try:
        got = _ENDED.get(group)
    except TypeError:
        got = None
    return got if got is not None else _ENDED_IDS.get(id(group))


def refuse_ended(groups: Sequence[Any], where: str) -> None:
    """Raise :class:`OutOfStepError` if the use of any of ``groups`` has ended on this rank."""
    if not (_ENDED or _ENDED_IDS):
        return
    for g in groups:
        why = ended(g)
        if why is not None:
            raise OutOfStepError(f"usp_hal: the use of the {where} ended on this rank after an earlier call, so this "
                                 f"call is refused before it communicates (it could pair with another call of the "
                                 f"other ranks); rebuild the process groups and the mesh to go on. The earlier "
                                 f"call: {why}")


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


_profiler_enabled = torch._C._autograd._profiler_enabled


def collective(what: str, where: str, fn: Callable, *args, **kwargs):
    """Run one collective; any failure becomes a :class:`CommError` naming ``what`` and ``where``.
    Under ``torch.profiler`` the call is labelled ``usp_hal: <what>`` in the trace (the check
    costs ~40 ns when no profiler runs; the label itself, ~7 us, only while one does).  The
    steady state builds no string: names are formatted only for a trace or an error."""
    try:
        if _profiler_enabled():
            with torch.profiler.record_function(f"usp_hal: {what}"):
                got = fn(*args, **kwargs)
        else:
            got = fn(*args, **kwargs)
    except CommError:
        raise
    except RuntimeError as exc:
        raise CommError(f"{what} on the {where} failed: {exc}") from exc
    return got


def wait(what: str, where: str, works) -> None:
    """Wait on the work handle(s) of an asynchronous collective, naming it (``wait for
    <what>``) in a trace and on failure."""
    if works is None:
        return
    if not isinstance(works, (list, tuple)):
        works = [works]
    for w in works:
        try:
            if _profiler_enabled():
                with torch.profiler.record_function(f"usp_hal: wait for {what}"):
                    w.wait()
            else:
                w.wait()
        except CommError:
            raise
        except RuntimeError as exc:
            raise CommError(f"wait for {what} on the {where} failed: {exc}") from exc


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


def digest_ints(values: Sequence[int]) -> int:
    """A non-zero 63-bit digest of a list of integers (the same on every rank): how variable
    length data (document boundaries, a batch's fingerprints) enters a fixed-length vector."""
    raw = struct.pack(f"<{len(values)}q", *[int(v) for v in values]) if values else b""
    return ((zlib.crc32(raw) << 31) ^ zlib.adler32(raw)) | 1


#: per process group: ``[its size, the device of its small host-side exchanges or None
#: until asked]``; neither changes while the group lives, and each costs microseconds to
#: ask for on every call
_GROUP_INFO: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _group_info(group) -> list:
    pg = group if group is not None else dist.group.WORLD
    info = _GROUP_INFO.get(pg) if pg is not None else None
    if info is None:
        info = [dist.get_world_size(group), None]
        if pg is not None:
            try:
                _GROUP_INFO[pg] = info
            except TypeError:        # a group object that takes no weak reference: asked every call
                pass
    return info


def _group_size(group) -> int:
    """``dist.get_world_size(group)``, asked once per group."""
    return _group_info(group)[0]


def group_meta(group) -> tuple:
    """``(_meta_device(group), dist.get_world_size(group))``, asked once per group."""
    info = _group_info(group)
    if info[1] is None:
        info[1] = _meta_device(group)
    return info[1], info[0]


def host_transport(group) -> bool:
    """The group moves host tensors itself: gloo (alone or beside a device backend), or
    torch's ``fake`` group (no communication: host-time measurements)."""
    name = str(dist.get_backend(group))
    return "gloo" in name or name in ("undefined", "fake")


def _meta_device(group) -> torch.device:
    """Small host-side exchanges go through gloo when the group has it, else the device."""
    acc = getattr(torch, "accelerator", None)
    if host_transport(group) or (acc is not None and not acc.is_available()):
        return torch.device("cpu")      # a host transport, or no accelerator to put the exchange on
    from ..dispatch import platform as _platform
    index = acc.current_device_index() if acc is not None else 0
    return torch.device(_platform.torch_device_name(_platform.default_device_type()), index)


def all_gather_single(*args, **kwargs):
    """``all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor``; looked up at
    call time so wrappers installed on ``torch.distributed`` see it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


_all_gather_single = all_gather_single     # the former private name (rotation, harness)


def all_gather_ints(values: Sequence[int], group=None, *, what: str = "metadata all-gather",
                    where: str = "sequence-parallel group") -> List[List[int]]:
    """Every rank's list of integers (all the same length), in group-rank order."""
    vals = list(values)
    return _split_rows(_gather_flat(vals, group, what, where), len(vals)) if vals else \
        [[] for _ in range(group_meta(group)[1])]


def _split_rows(flat: List[int], m: int) -> List[List[int]]:
    """A flat all-gather result cut into every rank's row of ``m`` (>= 1) values."""
    return [flat[i:i + m] for i in range(0, len(flat), m)]


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
    collective(what, where, all_gather_single, parts, buf, group=group)
    parts = parts.view(len(sizes), width).cpu()
    return [bytes(parts[i, :n].tolist()) for i, n in enumerate(sizes)]




# --------------------------------------------------------------------------------- agreement
Problem = Union[None, str, BaseException]


class AgreementError(ValueError):
    """Raised by :func:`agree` on every rank of a group, with the same message everywhere.

    ``problems``: rank (as named in messages) -> that rank's reason, for the ranks that
    refused the call locally (empty when the ranks merely disagree); ``rows``: every rank's
    values when they were compared (else None).  When every refusing rank raised the same
    builtin exception type (say ``TypeError``), the error is also an instance of that type;
    the class raised is named after it (``AgreementValueError``, ``AgreementTypeError``).
    """

    def __init__(self, message: str, problems: Optional[Dict[Any, str]] = None,
                 rows: Optional[List[List[int]]] = None):
        super().__init__(message)
        self.message = message
        self.problems = dict(problems or {})
        self.rows = rows

    def __str__(self) -> str:       # KeyError and friends would show the repr
        return self.message


_KINDS: Dict[str, type] = {}


def _error_class(kind: str = "ValueError") -> type:
    """The class :func:`agree` raises for refusals of builtin type ``kind``: a subclass of
    :class:`AgreementError` named ``Agreement<kind>`` that is also ``kind`` (ValueError for
    anything else), so that ``except TypeError`` and a type name in a message still work."""
    base = getattr(builtins, kind, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(base, ValueError):
        kind, base = "ValueError", ValueError
    if kind not in _KINDS:
        try:
            _KINDS[kind] = type(f"Agreement{kind}", (AgreementError,) if base is ValueError else (AgreementError, base),
                                {"__module__": __name__, "__qualname__": f"Agreement{kind}"})
        except TypeError:            # an incompatible layout (OSError and the like)
            return _error_class()
    return _KINDS[kind]


def _problem_text(problem: Problem) -> str:
    if problem is None:
        return ""
    if isinstance(problem, BaseException):
        return str(problem) or type(problem).__name__
    return str(problem)


def _group_ranks(group, n: int) -> List[Any]:
    if group is None or n == 1:
        return list(range(n))
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:
        return list(range(n))


class Repeat:
    """One agreement a caller makes again and again with the same values on the same group
    (a module's calls of one shape): this rank's values, and the gathered result the last
    time every check passed.  :func:`agree` with ``repeat=`` then costs one all-gather and
    one comparison of host integers while nothing changes; ``hit`` says whether the last
    call found the same result (the caller's own later checks of these rows need not run
    again: it may keep what it made of them in ``result``).  Any difference, on any rank,
    takes the full path.  Every exchange uses new tensors, so calls under
    ``torch.inference_mode``, ``torch.no_grad`` and with gradients may interleave."""

    __slots__ = ("values", "last", "rows", "hit", "result")

    def __init__(self, values: Sequence[int]):
        self.values = [int(x) for x in values]
        self.last: Optional[List[int]] = None     # the last gathered result every check accepted
        self.rows: Optional[List[List[int]]] = None
        self.hit = False
        #: what the caller worked out from the accepted rows once its own checks passed
        #: (cleared whenever other rows are accepted: it belongs to ``last`` alone)
        self.result: Any = None


def _gather_flat(values: List[int], group, what: str, where: str) -> List[int]:
    """Every rank's ``values`` (all the same length), one flat list in group-rank order."""
    device, n = group_meta(group)
    t = None
    if device.type == "cpu" and values:
        try:   # int64 straight from a C array: several times cheaper than from a list of ints
            t = torch.frombuffer(array.array("q", values), dtype=torch.long)
        except (TypeError, OverflowError, ValueError):
            t = None      # not plain int64 values: as torch.tensor takes them (or refuses them)
    if t is None:
        t = torch.tensor(list(values), dtype=torch.long, device=device)
    out = torch.empty(n * t.numel(), dtype=torch.long, device=t.device)
    collective(what, where, all_gather_single, out, t, group=group)
    return out.tolist()


#: an agreement's message is ``[flag, tag, *values]`` padded with zeros to a multiple of
#: this many integers, so that two different agreements of up to ``_BUCKET - 2`` values
#: meet in an all-gather of one size and their tags tell them apart
_BUCKET = 64


@functools.lru_cache(maxsize=256)
def agreement_tag(what: str, width: int) -> int:
    """The word that says which agreement a message belongs to: a digest of its label
    (``what``) and its number of values, the same on every rank."""
    return digest_ints(list(f"{width}:{what}".encode("utf-8", "replace")))


def _padded(n: int) -> int:
    """The length of an agreement message of ``n`` integers (header included)."""
    if n <= _BUCKET:
        return _BUCKET
    size = _BUCKET
    while size < n:
        size *= 2
    return size


def _gather_message(msg: List[int], tag: int, group, what: str, where: str,
                    ranks: Optional[Sequence[Any]]) -> List[int]:
    """Every rank's tagged message, flat in group-rank order.  One all-gather when it fits
    :data:`_BUCKET`; a longer one sends its first bucket alone first, so that a rank at
    another agreement (whose message may be of another length) is told apart, in an exchange
    of one size, before messages whose lengths could differ meet; then the rest."""
    if len(msg) <= _BUCKET:
        return _gather_flat(msg, group, f"{what}: agreement check", where)
    head = _gather_flat(msg[:_BUCKET], group, f"{what}: agreement check", where)
    _tagged_rows(head, _BUCKET - 2, tag, group, what, where, ranks, size=_BUCKET)   # raises on another tag
    rest = _gather_flat(msg[_BUCKET:], group, f"{what}: agreement values", where)
    heads, tails = _split_rows(head, _BUCKET), _split_rows(rest, len(msg) - _BUCKET)
    return [x for h, t in zip(heads, tails) for x in h + t]


def _tagged_rows(flat: List[int], n_values: int, tag: int, group, what: str, where: str,
                 ranks: Optional[Sequence[Any]], size: Optional[int] = None) -> List[List[int]]:
    """Every rank's ``[flag, *values]`` from a gathered ``[flag, tag, *values, 0...]``
    message; when some rank sent another agreement's tag (the ranks are not making the same
    call at this point), every rank raises the same :class:`AgreementError` naming what each
    rank was doing (one more exchange, of the labels, only then)."""
    size = _padded(n_values + 2) if size is None else size
    msgs = _split_rows(flat, size)
    if any(m[1] != tag for m in msgs):
        labels = all_gather_bytes(what.encode("utf-8", "replace"), group, what=f"{what}: agreement labels",
                                  where=where)
        names = list(ranks) if ranks is not None else _group_ranks(group, len(msgs))
        seen = "; ".join(f"rank {n}: {raw.decode('utf-8', 'replace')!r}" for n, raw in zip(names, labels))
        raise _error_class()(
            f"usp_hal: the ranks of the {where} are not at the same agreement (each rank's call of the library "
            f"must be the same call, in the same order, on every rank; check for a rank that skipped or added a "
            f"call, or took another branch); each rank's agreement: {seen}")
    return [[m[0], *m[2:n_values + 2]] for m in msgs]


def _message(flag: int, tag: int, values: Sequence[int]) -> List[int]:
    row = [flag, tag, *values]
    return row + [0] * (_padded(len(row)) - len(row))


def agree(problem: Problem, group=None, *, what: str, where: str = "sequence-parallel group",
          values: Sequence[int] = (), width: Optional[int] = None, same: Union[bool, Sequence[str]] = False,
          check: Optional[Callable[[List[List[int]]], Union[None, str, Sequence[str]]]] = None,
          ranks: Optional[Sequence[Any]] = None, repeat: Optional[Repeat] = None) -> List[List[int]]:
    """Agree across ``group`` (None = the default group) that a call may go on; every rank
    must call it at the same point.  Returns every rank's ``values``, in group-rank order.

    ``problem``: this rank's reason to refuse (a message or an exception), None or "" when its
    local checks passed.  ``values``: integers to share (per-rank data such as a local length,
    or a field vector to compare); every rank sends ``width`` of them (default: their number,
    which must then be the same on every rank; a rank that refused may send fewer, they are
    padded with zeros).

    One all-gather of ``[flag, tag, *values]`` (``tag``: :func:`agreement_tag`, which
    agreement this is; the message padded to a fixed size, so another agreement met at the
    same point is told apart, not read as this one's values); only when some rank flagged,
    a second one with the reasons.  Then, on every rank with the same inputs, so with the
    same outcome:

    * some rank sent another agreement's tag: :class:`AgreementError` naming every rank's
      agreement (the ranks are not making the same calls);

    * any rank flagged: :class:`AgreementError` ``"<what>: rank r: <reason>; ..."``, naming
      each refusing rank (``ranks``: the labels to use, default the group's global ranks);
    * ``same`` (True, or one label per value): the values must be equal on every rank, else
      the error names each differing value (by its label) and every rank's value of it;
    * ``check(rows)``: a further test of every rank's values (say, lengths that must fit a
      layout); a message or a list of messages it returns becomes the error.

    Outside a process group, or on a group of one rank, nothing is exchanged: ``problem``
    itself is raised (the exception, or an :class:`AgreementError` with the message).

    ``repeat``: this call's :class:`Repeat` (its values stand for ``values``; used only when
    this rank has no ``problem``): a result equal to the last accepted one returns that
    one's rows at once.
    """
    if _ENDED or _ENDED_IDS:
        refuse_ended([group if group is not None else dist.group.WORLD], where)
    text = _problem_text(problem)
    multi = dist.is_available() and dist.is_initialized() and _group_size(group) > 1
    if repeat is not None:
        repeat.hit = False
        if not text and multi:
            tag = agreement_tag(what, len(repeat.values))
            flat = _gather_message(_message(0, tag, repeat.values), tag, group, what, where, ranks)
            if flat == repeat.last:
                repeat.hit = True
                assert repeat.rows is not None
                return repeat.rows
            gathered = _tagged_rows(flat, len(repeat.values), tag, group, what, where, ranks)
            rows = settle(gathered, problem, group, what=what, where=where, same=same, check=check, ranks=ranks)
            # other rows accepted: what the caller made of the last ones no longer stands
            repeat.last, repeat.rows, repeat.result = flat, rows, None
            return rows
    row: List[int] = []
    try:
        row = list(map(int, values))
    except (TypeError, ValueError) as exc:
        text = text or f"{what}: the agreement values are not integers ({exc})"
    n_values = len(row) if width is None else int(width)
    row = (row + [0] * n_values)[:n_values]
    if not multi:
        if text:
            if isinstance(problem, BaseException):
                raise problem
            raise _error_class()(f"{what}: {text}", {0: text})
        return settle([[0] + row], problem, group, what=what, where=where, same=same, check=check, ranks=ranks)
    tag = agreement_tag(what, n_values)
    gathered = _tagged_rows(_gather_message(_message(1 if text else 0, tag, row), tag, group, what, where, ranks),
                            n_values, tag, group, what, where, ranks)
    return settle(gathered, problem, group, what=what, where=where, same=same, check=check, ranks=ranks)


def settle(gathered: List[List[int]], problem: Problem, group=None, *, what: str,
           where: str = "sequence-parallel group", same: Union[bool, Sequence[str]] = False,
           check=None, ranks=None) -> List[List[int]]:
    """The rest of :func:`agree` once every rank's ``[flag, *values]`` is here (a second
    all-gather, of the reasons, only when some rank's refusal bit (1) is set): raises as
    :func:`agree` does, or returns every rank's values.  Every rank must call it with the
    same ``gathered``."""
    text = _problem_text(problem)
    if len(gathered) > 1 and any(r[0] & 1 for r in gathered):
        names = list(ranks) if ranks is not None else _group_ranks(group, len(gathered))
        kind = type(problem).__name__ if isinstance(problem, BaseException) else ""
        texts = all_gather_bytes(f"{kind}\0{text}".encode("utf-8", "replace") if text else b"", group,
                                 what=f"{what}: agreement messages", where=where)
        problems, kinds = {}, set()
        for i, (r, raw) in enumerate(zip(gathered, texts)):
            if r[0] & 1:
                k, _, msg = raw.decode("utf-8", "replace").partition("\0")
                if msg.startswith(f"{what}: "):      # the reason names the call already
                    msg = msg[len(what) + 2:]
                problems[names[i]] = msg
                kinds.add(k)
        cls = _error_class(kinds.pop()) if len(kinds) == 1 else _error_class()
        by_reason: Dict[str, List[Any]] = {}     # one entry per distinct reason, naming its ranks
        for r, m in problems.items():
            by_reason.setdefault(m, []).append(r)
        err = cls(f"{what}: " + "; ".join(", ".join(f"rank {r}" for r in rs) + f": {m}"
                                           for m, rs in by_reason.items()), problems)
        if isinstance(problem, BaseException):
            raise err from problem
        raise err
    rows = [r[1:] for r in gathered]      # the gathered rows are lists: slices are new lists
    diffs = _differences(rows, same, ranks if ranks is not None else _group_ranks(group, len(rows))) \
        if same else []
    if not diffs and check is not None:
        found = check(rows)
        diffs = [found] if isinstance(found, str) else list(found or [])
    if diffs:
        raise _error_class()(f"{what}: " + ("; ".join(diffs) if len(diffs) == 1 else "\n  " + "\n  ".join(diffs)),
                             rows=rows)
    return rows


def _differences(rows: List[List[int]], same: Union[bool, Sequence[str]], names: Sequence[Any]) -> List[str]:
    """Messages for the values that differ between ranks (every rank's value of each)."""
    if all(r == rows[0] for r in rows):
        return []
    if isinstance(same, bool) or isinstance(same, str):
        return ["the ranks were called with different arguments (every rank must pass the same ones): "
                + "; ".join(f"rank {n}: {tuple(r)}" for n, r in zip(names, rows))]
    labels = list(same)
    out = []
    for j, label in enumerate(labels):
        vals = [r[j] if j < len(r) else None for r in rows]
        if len(set(vals)) > 1:
            out.append(f"{label}: " + ", ".join(f"rank {n}={v}" for n, v in zip(names, vals)))
    return out or ["the ranks' values differ: " + "; ".join(f"rank {n}: {tuple(r)}" for n, r in zip(names, rows))]
