"""Step 2 of a call: every rank learns every rank's local length and sees any rank's
refusal or any disagreement, from one small all-gather of the spec's metadata vector (on
the mesh's CPU side group when the group has no CPU transport), through the library's one
agreement primitive, :func:`usp_hal.comm.agree`.  All ranks then raise the
same error together, so none waits in a data collective."""
from __future__ import annotations

import builtins
from typing import List, Optional

import torch

from .. import comm
from ..comm import AgreementError
from ..layout import local_lengths, local_positions
from ..spec import CallSpec, compare, digest_ints, field_index, meta_length
from .validate import USPError, share

_WHAT = "attention call metadata"   # the label of its all-gather in traces and errors


def joint_total(spec: CallSpec) -> int:
    return int(spec.joint.split(":")[1])


#: the flag bit a rank sets when this call is not the same as its last one (see :class:`Ahead`)
CHANGED = 2
#: ... and when it is on another mesh than the last one (its rows are then agreed on again there)
MOVED = 4


def agree(pipe, mesh, spec: Optional[CallSpec], err, cu_seqlens=None, *, same: bool = False,
          gathered: Optional[List[List[int]]] = None, refusals_only: bool = False) -> List[int]:
    """Every rank's local length, after making sure every rank can run this call and all
    agree on it; raises the same error on every rank otherwise.  ``cu_seqlens``: the
    validated document boundaries of a packed call (their digest is in the spec).

    ``same``: this rank's call is the same as its last one (same signature and mesh);
    ``pipe.steady`` is then set to whether every rank said so.  ``gathered``: every rank's
    ``[flag, *values]`` already exchanged (by a call that went ahead, :class:`Ahead`);
    ``refusals_only``: only raise the refusals among them (rows from another mesh's group:
    returns ``[]``)."""
    pipe.steady = False
    n = mesh.sp_size
    if n == 1:
        if err is not None:
            raise err
        assert spec is not None
        if cu_seqlens is not None:
            check_layout(pipe, mesh, spec, [spec.local_len], None, cu_seqlens)
        return [spec.local_len]
    if pipe.static_shapes and pipe.frozen is not None and err is None and spec is not None:
        frozen, lengths = pipe.frozen
        if spec == frozen:
            return lengths
        diffs = compare([frozen.meta(), spec.meta()], ["frozen", "this call"], spec)
        raise USPError("static_shapes=True: this call differs from the first (checked) one, so it cannot "
                       "run without a metadata exchange; use a module with static_shapes=False for "
                       "changing shapes (this rank only; the other ranks stop at the group timeout):\n  "
                       + "\n  ".join(diffs))
    group = mesh.metadata_group
    where = mesh.where("sequence-parallel")
    problem = None if err is None else f"{type(err).__name__}: {err}"
    flag = 0 if same else CHANGED
    if gathered is not None:
        rep = None
    else:
        rep = pipe.repeats.get((spec, group, flag)) if err is None and spec is not None else None
    width, values = row_values(pipe, spec, err, rep)
    if rep is None and err is None and spec is not None and gathered is None:
        # a call of this spec again: one all-gather into the same buffer and one comparison
        if len(pipe.repeats) > 64:
            pipe.repeats.clear()
        rep = pipe.repeats[(spec, group, flag)] = comm.Repeat(values, flag)

    def differences(rows):
        if not pipe.check_ranks or all(r == rows[0] for r in rows[1:]):
            return None
        return compare([[0] + r for r in rows], mesh.sp_ranks, spec)

    flags: List[int] = []
    try:   # one all-gather of every rank's metadata (a second one with the reasons, only on a refusal)
        if gathered is not None:
            rows = comm.settle(gathered, problem, group, what=_WHAT, where=where,
                               ranks=mesh.sp_ranks, check=None if refusals_only else differences)
            flags = [r[0] for r in gathered]
        else:
            rows = comm.agree(problem, group, what=_WHAT, where=where, values=values, width=width,
                              ranks=mesh.sp_ranks, check=differences, repeat=rep, flag=flag, flags=flags)
    except AgreementError as exc:
        if exc.problems:     # the same error on every rank, the refusing ones included
            raise refusal(exc.problems) from err
        found = str(exc)[len(_WHAT) + 2:].strip()
        raise USPError("ranks of the sequence-parallel group disagree on this attention call "
                       "(every rank must pass the same shapes and options):\n  " + found) from None
    if refusals_only:
        return []
    assert spec is not None      # no rank flagged an error, so this one has a spec
    steady = not any(flags)
    if rep is not None and rep.hit and rep.result is not None:
        pipe.steady = steady
        return rep.result       # the same rows as the last call whose checks all passed
    rows = [[0] + r for r in rows]
    if pipe.check_ranks:
        lengths = [r[field_index("local_len")] for r in rows]
    else:
        lengths = [r[1] for r in rows]
    check_layout(pipe, mesh, spec, lengths, rows if pipe.check_ranks else None, cu_seqlens)
    if rep is not None:
        rep.result = lengths
    if pipe.static_shapes:
        pipe.frozen = (spec, lengths)
    pipe.steady = steady
    return lengths


_REFUSALS: dict = {}


def refusal(problems) -> USPError:
    """The error every rank raises when some rank(s) refused a call: it names each refusing
    rank and its reason (``"<type>: <message>"``), and is also an instance of the refusals'
    exception type when they share one (``except TypeError`` still works)."""
    kinds = {str(m).split(":", 1)[0] for m in problems.values()}
    base = getattr(builtins, kinds.pop(), None) if len(kinds) == 1 else None
    cls: type = USPError
    if isinstance(base, type) and issubclass(base, Exception) and not issubclass(base, ValueError):
        cls = _REFUSALS.get(base) or USPError
        if base not in _REFUSALS:
            try:
                cls = _REFUSALS[base] = type(f"USP{base.__name__}", (USPError, base), {"__module__": __name__})
            except TypeError:        # an incompatible layout
                _REFUSALS[base] = USPError
    return cls(f"attention call refused on rank(s) {list(problems)} of the sequence-parallel group:\n"
               + "\n".join(f"  rank {r}: {m}" for r, m in problems.items()))


def row_values(pipe, spec: Optional[CallSpec], err, rep=None):
    """``(width, values)``: what this rank sends after its flag in the agreement (its spec's
    metadata, or only its length when ``check_ranks=False``; nothing for a refusal)."""
    if pipe.check_ranks:
        width = meta_length() - 1
        values = [] if spec is None or err is not None else rep.values if rep is not None else pipe.meta_of(spec)[1:]
    else:
        values = [] if spec is None or err is not None else [spec.local_len]
        width = 1
    return width, values


class Ahead:
    """A module whose calls are steady (its last call was, on every rank, the same as the
    one before) runs its next call *ahead of* the agreement: the agreement's all-gather
    starts, the call's plan runs at once, and the all-gather is waited for when the call's
    first exchange has completed (:func:`usp_hal.comm.open_gate`), so its latency hides
    behind that exchange (and, in a ring, behind the rank's own block) instead of coming
    before it.

    Every rank goes ahead with the *last* call's plan, so every exchange has the last
    call's sizes on every rank: a rank whose call changed (or failed its local checks)
    runs that plan on zeros of the last call's shapes, sets its flag, and at the first
    exchange every rank sees the flag and drops what it ran (:class:`usp_hal.comm.Retry`);
    the call is then agreed on in full from the gathered rows (refused on every rank, or
    planned and run; when some rank's call is on another mesh, its refusals are raised and
    the call is agreed on again on the new mesh).  What goes ahead therefore never reaches
    the caller unless every rank ran it on its own call, and no rank is left waiting in an
    exchange."""

    __slots__ = ("mesh", "sig", "plan", "send", "recv", "group", "inputs", "sinks", "what", "where", "carry")

    def __init__(self, pipe, mesh, sig, spec: CallSpec, plan, q, k, v, sinks):
        self.mesh, self.sig, self.plan = mesh, sig, plan
        self.what, self.where = f"{_WHAT}: agreement check", mesh.where("sequence-parallel")
        self.group = mesh.metadata_group
        width, values = row_values(pipe, spec, None)
        device, n = comm.group_meta(self.group)
        self.send = torch.tensor([0] + values, dtype=torch.long, device=device)
        self.recv = torch.empty(n * (width + 1), dtype=torch.long, device=device)
        self.inputs = tuple((t.shape, t.dtype, t.device) for t in (q, k, v))
        self.sinks = None if sinks is None else (sinks.shape, sinks.dtype, sinks.device)
        # a ring-only plan on host tensors whose rotation can carry the flag in its K/V
        # messages needs no all-gather unless some rank's flag is set (comm.open_carried_gate)
        st = plan.stages
        self.carry = (len(st) == 1 and st[0].exchange.size == 1
                      and st[0].ring.rotation.carries_flag(k.shape, v.shape, k.dtype, k.device))

    def start(self, send=None) -> None:
        """Start the agreement of this call (``send``: this rank's row when it changed)."""
        row = self.send if send is None else send
        if self.carry:      # (a steady call's flag is 0: read back only from a changed call's row)
            comm.open_carried_gate(row, self.recv, self.group, what=self.what, where=self.where,
                                   flag=0 if send is None else int(send[0]))
        else:
            comm.open_gate(row, self.recv, self.group, what=self.what, where=self.where)

    def width_changed(self, pipe) -> bool:
        """The pipeline's row width is not this agreement's (its ``check_ranks`` changed)."""
        return row_values(pipe, None, None)[0] + 1 != self.send.numel()

    def row(self, pipe, spec: Optional[CallSpec], err, mesh):
        """This rank's ``[flag, *values]`` for a call that is not the last one, as wide as
        this agreement's rows (the caller refuses a call whose width changed)."""
        _, values = row_values(pipe, spec, err)
        width = self.send.numel() - 1
        row = ([1 if err is not None or spec is None else 0] + list(values) + [0] * width)[:width + 1]
        row[0] |= CHANGED | (MOVED if mesh is not self.mesh else 0)
        return torch.tensor(row, dtype=torch.long, device=self.send.device)

    def zeros(self):
        """Zeros of the last call's q, k, v (and sinks) shapes: what a rank whose call changed runs."""
        q, k, v = (torch.zeros(s, dtype=d, device=dev) for s, d, dev in self.inputs)
        sinks = None if self.sinks is None else torch.zeros(self.sinks[0], dtype=self.sinks[1], device=self.sinks[2])
        return q, k, v, sinks


def check_layout(pipe, mesh, spec: CallSpec, lengths, rows, cu=None) -> None:
    """The ranks' lengths (and, with ``positions=``, their positions) fit the layout."""
    R, U = mesh.ring_degree, mesh.ulysses_degree
    if spec.joint:   # the main tokens' lengths follow the layout; the joint shares were checked locally
        total = joint_total(spec)
        lengths = [n - share(total, mesh.sp_size, i)[1] for i, n in enumerate(lengths)]
    seqlen = sum(lengths)
    layout = pipe.layout.name
    key = (tuple(lengths), R, U, layout, cu, spec.causal or spec.positional)
    if rows is None or not spec.positions:
        if key in pipe.checked_layouts:
            return
    per = [[lengths[mesh.sp_index(r, u)] for u in range(U)] for r in range(R)]
    if cu is not None and cu[-1] != seqlen:
        raise USPError(f"cu_seqlens ends at {cu[-1]}, but the ranks hold {seqlen} tokens in all "
                       f"(local lengths {per}, ring x ulysses); the last boundary must be the global length S")
    if spec.causal or spec.positional or cu is not None:
        expect = local_lengths(layout, seqlen, R, U, cu_seqlens=cu)
        if per != expect:
            how = f"layout={layout!r}" + (", cu_seqlens=cu_seqlens" if cu is not None else "")
            raise USPError(f"local sequence lengths {per} (ring x ulysses) do not match the {layout!r} layout "
                           f"for S={seqlen}{' and these documents' if cu is not None else ''} (expected "
                           f"{expect}); shard inputs with usp_hal.shard(x, {how}) (causal/window/alibi and "
                           f"document boundaries depend on positions)")
    if rows is not None and spec.positions:
        idx = field_index("positions")
        wrong = []
        for i, r in enumerate(rows):
            pos = local_positions(layout, seqlen, R, U, mesh.ring_of(i), mesh.ulysses_of(i), cu_seqlens=cu)
            if r[idx] != digest_ints(pos.tolist()):
                wrong.append(mesh.sp_ranks[i])
        if wrong:
            raise USPError(f"rank(s) {wrong} hold other positions than the {layout!r} layout gives them for "
                           f"S={seqlen} (checked because positions= was passed); shard inputs with "
                           f"usp_hal.shard(x, layout={layout!r})")
        return
    if len(pipe.checked_layouts) > 64:
        pipe.checked_layouts.clear()
    pipe.checked_layouts.add(key)
