"""The Ulysses exchange: one all-to-all from sequence shards to head shards and one back.

Every tensor travels *sequence-major*: rank ``u`` sends each peer the heads that peer
computes, for all of its own tokens, as ``[s_u, B, h, D]``.  The receive buffer is then
``[S, B, h, D]`` with the sources in sequence order, which *is* the gathered sequence:
no reassembly copy.

**Packed.**  q, k and v (with their own head counts under GQA) travel in ONE all-to-all:
per destination the three tensors' heads are concatenated along the head axis, so the
received ``[S, B, hq + hk + hk, D]`` buffer holds all three and q, k, v are views of it.
In backward, dq, dk and dv travel back the same way in one all-to-all.  When the tensors
cannot share one buffer along heads (different head dims or dtypes, or a wire codec that
turns a tensor into several), every part travels as bytes in one all-to-all instead.

**Heads.**  :func:`head_plan` gives each Ulysses rank a contiguous range of query heads, as
even as possible (ranks beyond ``H`` get none).  Only the distinct KV heads a rank's query
heads use travel; when the range cuts a GQA group (e.g. ``H=6, Hkv=3, U=2``), the rank
repeats the received KV heads locally (one per query head) instead of receiving copies, and
sums their gradients back before sending them home.  ``Hkv % U == 0`` is never needed.

**Codecs.**  Each tensor can go through a wire codec (``usp_hal.codec``): identity by
default, FP8 with per-token, per-head scales when asked.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import wire
from .codec import IDENTITY
from .comm import collective, gloo_transport, wait


# ------------------------------------------------------------------------------------ heads
@dataclass(frozen=True)
class HeadPlan:
    """Which global heads each Ulysses rank computes.

    ``q[u]``: the contiguous query-head range ``(start, stop)`` of rank ``u``.  ``kv[u]``:
    the contiguous range of distinct global KV heads its query heads use (what travels).
    ``kv_expand[u]``: ``None`` when the kernel can run GQA locally (every received KV head
    serves the same number of local query heads), else, per local query head, the index of
    its KV head in ``kv[u]`` (the rank repeats KV heads locally).
    """

    num_heads: int
    num_kv_heads: int
    q: Tuple[Tuple[int, int], ...]
    kv: Tuple[Tuple[int, int], ...]
    kv_expand: Tuple[Optional[Tuple[int, ...]], ...]

    @property
    def size(self) -> int:
        return len(self.q)

    def local_heads(self, u: int) -> Tuple[int, int]:
        """(query heads, KV heads) the kernel sees on Ulysses rank ``u``."""
        a, b = self.q[u]
        exp = self.kv_expand[u]
        return b - a, (len(exp) if exp is not None else self.kv[u][1] - self.kv[u][0])

    def q_heads(self, u: int) -> range:
        return range(*self.q[u])

    def kv_heads(self, u: int) -> range:
        return range(*self.kv[u])

    @property
    def kv_shared(self) -> bool:
        """Some KV head is received by more than one rank (its gradients must be summed)."""
        seen: set = set()
        for a, b in self.kv:
            if any(h in seen for h in range(a, b)):
                return True
            seen.update(range(a, b))
        return False

    def wire_kv_heads(self) -> int:
        """KV heads sent in total (summed over ranks): what the all-to-all moves for k and v."""
        return sum(b - a for a, b in self.kv)


def head_plan(num_heads: int, num_kv_heads: int, ulysses: int) -> HeadPlan:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"heads={num_heads} must be a positive multiple of kv_heads={num_kv_heads}")
    g = num_heads // num_kv_heads
    base, extra = divmod(num_heads, ulysses)
    q, kv, expand, start = [], [], [], 0
    for u in range(ulysses):
        n = base + (1 if u < extra else 0)
        a, b = start, start + n
        start = b
        q.append((a, b))
        r, e = _kv_for(a, b, g)
        kv.append(r)
        expand.append(e)
    return HeadPlan(num_heads, num_kv_heads, tuple(q), tuple(kv), tuple(expand))


def _kv_for(a: int, b: int, g: int):
    """KV range and local expansion for the query heads [a, b) (see :class:`HeadPlan`)."""
    if b <= a:
        return (0, 0), None
    ga, gb = a // g, (b - 1) // g + 1
    counts = [min(b, (x + 1) * g) - max(a, x * g) for x in range(ga, gb)]
    return (ga, gb), (None if len(set(counts)) == 1 else tuple(h // g - ga for h in range(a, b)))


def _split_units(plan: HeadPlan, u: int) -> Tuple[int, int]:
    """``(units, heads per unit)`` rank ``u``'s heads split into: whole KV groups where it runs
    GQA locally on two or more KV heads, else single query heads."""
    a, b = plan.q[u]
    ka, kb = plan.kv[u]
    if plan.kv_expand[u] is None and kb - ka >= 2:
        return kb - ka, (b - a) // (kb - ka)
    return b - a, 1


def most_groups(plan: HeadPlan) -> int:
    """The most head groups :func:`split_plan` makes without an empty group on every rank."""
    return max([1] + [_split_units(plan, u)[0] for u in range(plan.size)])


def split_plan(plan: HeadPlan, chunks: int) -> List[HeadPlan]:
    """Split every rank's heads into ``chunks`` consecutive groups (for pipelining the
    all-to-all of one group with the kernel of another).  Where a rank runs GQA locally the
    split follows whole KV groups, so no KV head travels twice; with fewer than two local KV
    heads the query heads are split evenly and a KV head may travel with several groups.
    Groups may be empty on some ranks (never on all)."""
    g = plan.num_heads // plan.num_kv_heads
    rows = []   # per rank: the chunks' query ranges
    for u in range(plan.size):
        a = plan.q[u][0]
        units, step = _split_units(plan, u)
        base, extra = divmod(units, chunks)
        cur, mine = a, []
        for c in range(chunks):
            n = (base + (1 if c < extra else 0)) * step
            mine.append((cur, cur + n))
            cur += n
        rows.append(mine)
    out = []
    for c in range(chunks):
        if all(rows[u][c][0] == rows[u][c][1] for u in range(plan.size)):
            continue   # empty on every rank
        q, kv, exp = [], [], []
        for u in range(plan.size):
            a, b = rows[u][c]
            r, e = _kv_for(a, b, g)
            q.append((a, b))
            kv.append(r)
            exp.append(e)
        out.append(HeadPlan(plan.num_heads, plan.num_kv_heads, tuple(q), tuple(kv), tuple(exp)))
    return out


# ------------------------------------------------------------------------------- streams
@dataclass
class _Part:
    """One tensor on the wire: ``data`` is ``[B, S, H, d]`` (sequence->heads side) or
    ``[S, B, h, d]`` (heads->sequence side); ``heads[u]`` the head range for rank ``u``."""

    data: torch.Tensor
    heads: Sequence[Tuple[int, int]]


class Pending:
    """An all-to-all in flight: ``wait()`` returns the decoded tensors; ``result`` (for a
    single-tensor exchange) is the tensor that ``wait()`` fills."""

    result: Optional[torch.Tensor] = None

    def __init__(self, work, finish, what: str, where: str):
        self._work, self._finish, self._what, self._where = work, finish, what, where

    def wait(self):
        if self._work is not None:
            wait(self._what, self._where, self._work)
        return self._finish()


class UlyssesExchange:
    """Sequence <-> heads all-to-alls over one Ulysses group for one call's shapes.

    ``seq_lens[u]``: tokens rank ``u`` holds (uneven allowed); ``plan``: the heads each
    rank computes.  ``codecs`` maps ``"q"``, ``"k"``, ``"v"``, ``"out"`` to a wire codec.
    """

    #: a bound forward on host tensors over gloo sends q, k and v in one all-to-all each, not
    #: packed, once the largest rank's share of one of them is this many bytes (0: never).
    #: There the three messages cost what one does (gloo moves big messages at memory speed)
    #: and the CPU kernel reads contiguous tensors instead of views with a 3x row stride
    #: (1-2% of its time at Ulysses-2, S=8192).  Devices always pack: one launch, not three.
    SPLIT_BYTES = 4 << 20

    def __init__(self, plan: HeadPlan, group, rank: int, seq_lens: Sequence[int], *,
                 where: str = "ulysses group", codecs: Optional[dict] = None):
        if plan.size != len(seq_lens):
            raise ValueError(f"head plan for {plan.size} ranks, lengths for {len(seq_lens)}")
        self.plan, self.group, self.rank = plan, group, rank
        self.seq_lens = tuple(int(n) for n in seq_lens)
        self.size = len(self.seq_lens)
        self.total = sum(self.seq_lens)
        self.offsets = tuple(sum(self.seq_lens[:u]) for u in range(self.size))
        self.where = where
        self.codecs = {name: IDENTITY for name in ("q", "k", "v", "out")}
        self.codecs.update(codecs or {})
        # steady state: what depends only on the plan, the lengths and the call's shapes is
        # worked out once (see :class:`_Route`); a call looks its route up by shapes and dtypes
        self._rows_to = [1] * self.size         # one block per destination (dim 0 of a gathered buffer)
        self._lens = list(self.seq_lens)        # rows of a sequence-major buffer per rank
        self._routes: dict = {}
        self._labels: dict = {}
        exp = plan.kv_expand[rank] if 0 <= rank < plan.size else None
        self._expand = exp
        self._expand_idx: dict = {}             # device -> the index tensor of ``exp``

    # ------------------------------------------------------------------ forward in
    def qkv_to_heads(self, q, k, v):
        return self.start_qkv(q, k, v).wait()

    def start_qkv(self, q, k, v, *, async_op: bool = False, what: str = "forward") -> "Pending":
        """Start sending q, k, v ([B, s, H|Hkv, D], this rank's tokens) to the ranks that
        compute their heads; ``wait()`` gives ``(qh, kh, vh)`` ``[B, S, h, D]`` views."""
        plan, me = self.plan, self.rank
        if self.size == 1:
            return Done(self._local_qkv(q, k, v))
        route = self._qkv_route(q, k, v)
        label = self._labels.get(what)
        if label is None:
            label = self._labels[what] = f"Ulysses all-to-all of q/k/v ({what})"
        if route:
            recv, work = self._send_gathered(route, (q, k, v), async_op, label)
            return Pending(work, lambda: self._finish_qkv(route, recv), label, self.where)
        parts, names = [_Part(q, plan.q)], ["q"]
        parts += [_Part(k, plan.kv), _Part(v, plan.kv)]
        names += ["k", "v"]
        enc = [self.codecs[n] for n in names]
        if all(c.identity for c in enc) and _homogeneous([q, k, v]):
            recv, work = self._heads_fast(parts, async_op, label)
            hq, hk = plan.q[me][1] - plan.q[me][0], plan.kv[me][1] - plan.kv[me][0]

            def finish():
                buf = recv
                qh = buf[:, :, :hq].permute(1, 0, 2, 3)
                kh = buf[:, :, hq:hq + hk].permute(1, 0, 2, 3)
                vh = buf[:, :, hq + hk:].permute(1, 0, 2, 3)
                return self.expand(qh, kh, vh)
            return Pending(work, finish, label, self.where)
        wire, slots = [], []
        for part, codec in zip(parts, enc):
            pieces = codec.encode(part.data)
            slots.append((codec, len(pieces), part.data.dtype))
            wire += [_Part(p, part.heads) for p in pieces]
        recv, work = self._heads_bytes(wire, async_op, label)

        def finish_bytes():
            got, i = [], 0
            outs = recv()
            for codec, n, dtype in slots:
                got.append(codec.decode([o.permute(1, 0, 2, 3) for o in outs[i:i + n]], dtype))
                i += n
            return self.expand(*got)
        return Pending(work, finish_bytes, label, self.where)

    def bind_forward(self, q, k, v):
        """For forward-only calls of these shapes and dtypes: ``(to_heads, to_seq)``, the two
        exchanges of a Ulysses forward with nothing around them, when both take their routes
        (identity codecs, heads in one regular pattern, the output's heads tiling ``[0, H)``
        in rank order, no kv-head repeat): ``to_heads(q, k, v) -> (qh, kh, vh)`` as
        :meth:`start_qkv` gives them, ``to_seq(out, dtype) -> [B, s, H, Dv]`` as
        :meth:`start_out` does without lse, guard or head-layout copy.  None otherwise."""
        plan = self.plan
        if self.size == 1 or self._expand is not None:
            return None
        route = self._qkv_route(q, k, v)
        if not route:
            return None
        me = self.rank
        out_shape = (q.shape[0], self.total, plan.q[me][1] - plan.q[me][0], v.shape[3])
        oroute = self._route_out(out_shape)
        if not oroute or not oroute.tiles:
            return None
        qlabel, olabel = "Ulysses all-to-all of q/k/v (forward)", "Ulysses all-to-all of the output (forward)"
        # on the CPU the send and receive buffers are this thread's scratch (:class:`_Scratch`):
        # everything read from them is consumed before the call returns (the result is a new
        # tensor), and the call is synchronous
        scratch = _SCRATCH if q.device.type == "cpu" else None
        each = self._split_routes(q, k, v) if scratch is not None else None

        if each is not None:
            labels = [f"Ulysses all-to-all of {n} (forward)" for n in ("q", "k", "v")]

            def to_heads(q, k, v):
                return tuple(self._send_gathered(r, (x,), False, lab, scratch, n)[0].permute(1, 0, 2, 3)
                             for x, r, lab, n in zip((q, k, v), each, labels, ("q", "k", "v")))
        else:
            def to_heads(q, k, v):
                recv, _ = self._send_gathered(route, (q, k, v), False, qlabel, scratch)
                return self._finish_qkv(route, recv)

        def to_seq(out, dtype):
            local, _, _ = self._start_out_routed(oroute, out, dtype, None, False, None, False, olabel).wait()
            return local
        return to_heads, to_seq

    def _split_routes(self, q, k, v):
        """The three one-tensor routes of a bound forward that sends q, k and v apart
        (:attr:`SPLIT_BYTES`), or None (they travel packed).  Decided from what every rank
        knows alike (the group's backend, the largest rank's share), so all send the same
        number of messages."""
        plan, most = self.plan, max(self.seq_lens)
        share = max(most * x.shape[0] * x.shape[2] * x.shape[3] * x.element_size() for x in (q, k, v))
        if self.SPLIT_BYTES <= 0 or share < self.SPLIT_BYTES or not gloo_transport(self.group):
            return None
        routes = [self._route_heads((x,), (rows,)) for x, rows in zip((q, k, v), (plan.q, plan.kv, plan.kv))]
        return routes if all(routes) else None

    def _qkv_route(self, q, k, v):
        """The route of q/k/v of these shapes and dtypes to the head layout (worked out once;
        False: the general path)."""
        key = ("qkv", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype)
        route = self._routes.get(key)
        if route is None:
            plan = self.plan
            route = self._routes[key] = self._route_heads((q, k, v), (plan.q, plan.kv, plan.kv), ("q", "k", "v"))
        return route

    def _local_qkv(self, q, k, v):
        # one Ulysses rank: nothing travels, so no codec applies
        a, b = self.plan.kv[0]
        if (a, b) != (0, k.shape[2]):
            k, v = k.narrow(2, a, b - a), v.narrow(2, a, b - a)
        return self.expand(q, k, v)

    def expand(self, qh, kh, vh):
        """Repeat KV heads for a rank whose query heads cut a GQA group (else as they are)."""
        exp = self._expand
        if exp is not None:
            idx = self._index(kh.device)
            kh, vh = kh.index_select(2, idx), vh.index_select(2, idx)
        return qh, kh, vh

    def _index(self, device) -> torch.Tensor:
        """``kv_expand`` of this rank as a long tensor on ``device`` (built once per device)."""
        idx = self._expand_idx.get(device)
        if idx is None:
            idx = self._expand_idx[device] = torch.tensor(self._expand, dtype=torch.long, device=device)
        return idx

    # ------------------------------------------------------------------ one tensor
    def start_heads(self, x: torch.Tensor, kind: str, *, async_op: bool = False,
                    what: str = "forward", name: Optional[str] = None) -> "Pending":
        """One tensor, sequence -> heads (``kind`` "q" or "kv": which heads travel where;
        ``name`` "q", "k" or "v": which wire codec applies).  ``wait()`` gives ``[B, S, h,
        D]`` (KV heads not yet repeated for cut groups); the Pending's ``result`` is that
        tensor already (filled once ``wait()`` returns)."""
        rows = self.plan.q if kind == "q" else self.plan.kv
        if self.size == 1:
            a, c = rows[0]
            done = Done(x if (a, c) == (0, x.shape[2]) else x.narrow(2, a, c - a))
            done.result = done.value
            return done
        label = f"Ulysses all-to-all of {name or kind} ({what})"
        codec = self.codecs[name or ("q" if kind == "q" else "k")]
        if codec.identity:
            key = ("heads", kind, x.shape, x.dtype)
            route = self._routes.get(key)
            if route is None:
                route = self._routes[key] = self._route_heads((x,), (rows,))
            if route:
                recv, work = self._send_gathered(route, (x,), async_op, label)
            else:
                recv, work = self._heads_fast([_Part(x, rows)], async_op, label)
            res = recv.permute(1, 0, 2, 3)
            p = Pending(work, lambda: res, label, self.where)
            p.result = res
            return p
        pieces = codec.encode(x)
        unpack, work = self._heads_bytes([_Part(t, rows) for t in pieces], async_op, label)
        a, c = rows[self.rank]
        result = torch.empty((x.shape[0], self.total, c - a, x.shape[3]), dtype=x.dtype, device=x.device)

        def finish():
            result.copy_(codec.decode([o.permute(1, 0, 2, 3) for o in unpack()], x.dtype))
            return result
        p = Pending(work, finish, label, self.where)
        p.result = result
        return p

    def heads_to_seq(self, g: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of :meth:`start_heads` for a gradient: ``[B, S, h, D]`` -> this rank's
        ``[B, s, H|Hkv, D]`` in ``dtype`` (KV heads that several ranks used are summed)."""
        plan = self.plan
        rows, total = (plan.q, plan.num_heads) if kind == "q" else (plan.kv, plan.num_kv_heads)
        reduce = kind != "q" and plan.kv_shared
        if self.size == 1:
            a, c = rows[0]
            if (a, c) == (0, total):
                return g.to(dtype)
            out = g.new_zeros(g.shape[0], g.shape[1], total, g.shape[3], dtype=dtype)
            out[:, :, a:c] = g
            return out
        label = f"Ulysses all-to-all of d{kind} (backward)"
        send = _convert(g.transpose(0, 1), dtype, None).contiguous()
        chunks, work = self._seq_fast(send, [c - a for a, c in rows], label, False)
        wait(label, self.where, work)
        return self._place_heads([chunks], [rows], g.shape[3], dtype, g.device, total=total, reduce=reduce)[0]

    def saved_to_heads(self, q, k, v, out, dout, lse):
        """Everything a backward needs, in the head layout: ``(qh, kh, vh, outh, douth,
        lse_h)`` with KV heads repeated for cut groups and ``lse_h`` ``[B, h, S]`` (``lse`` is
        the local ``[B, H, s]``).

        When q, k, v and out share dtype and head dim they travel from one gathered copy in
        one all-to-all and come back as views of its receive buffer (no unpack copies); dout
        follows in a second one (its own buffer: kernels take a contiguous output gradient
        without a copy, and this send buffer is the smaller), the lse, in its own dtype, in a
        third, small one.  Each send buffer goes as soon as its all-to-all has completed, so
        the peak is the first exchange's send and receive buffers (4 + 4 of the 5 + 5 one
        all-to-all of everything would hold).  Otherwise every part travels as bytes in one
        all-to-all."""
        plan = self.plan
        if self.size == 1:
            kh, vh = self._local_qkv(q, k, v)[1:]
            return q, kh, vh, out, dout, lse
        lse4 = lse.transpose(1, 2).unsqueeze(-1)            # [B, s, H, 1]
        label = "Ulysses all-to-all of q/k/v/out/dout/lse (compiled backward)"
        xs, rows = (q, k, v, out), (plan.q, plan.kv, plan.kv, plan.q)
        key = ("saved", q.shape, k.shape, v.shape, out.shape, dout.shape, lse.shape,
               q.dtype, k.dtype, v.dtype, out.dtype, dout.dtype, lse.dtype)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._route_saved(xs, rows, dout, lse4)
        if route:
            r_main, r_dout, r_lse = route
            recv = self._gather_heads(r_main, xs, rows, label)
            drecv = self._gather_heads(r_dout, (dout,), (plan.q,), label)
            lrecv = self._gather_heads(r_lse, (lse4,), (plan.q,), label)
            me = self.rank
            hq, hk = plan.q[me][1] - plan.q[me][0], plan.kv[me][1] - plan.kv[me][0]
            qh, kh, vh, oh = recv.permute(1, 0, 2, 3).split_with_sizes((hq, hk, hk, hq), 2)
            qh, kh, vh = self.expand(qh, kh, vh)
            return qh, kh, vh, oh, drecv.permute(1, 0, 2, 3), lrecv.squeeze(-1).permute(1, 2, 0).contiguous()
        xs, rows = xs + (dout, lse4), rows + (plan.q, plan.q)
        parts = [_Part(x, r) for x, r in zip(xs, rows)]
        unpack, work = self._heads_bytes(parts, False, label)
        wait(label, self.where, work)
        qh, kh, vh, oh, dh, lh = (t.permute(1, 0, 2, 3) for t in unpack())
        qh, kh, vh = self.expand(qh, kh, vh)
        return qh, kh, vh, oh, dh, lh.squeeze(-1).transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ forward out
    def out_to_seq(self, out: torch.Tensor, dtype: torch.dtype, lse: Optional[torch.Tensor] = None,
                   q_guard: Optional[torch.Tensor] = None, *, keep_heads: bool = False):
        return self.start_out(out, dtype, lse, q_guard, keep_heads=keep_heads).wait()

    def start_out(self, out: torch.Tensor, dtype: torch.dtype, lse: Optional[torch.Tensor] = None,
                  q_guard: Optional[torch.Tensor] = None, *, keep_heads: bool = False, into=None,
                  lse_into=None, async_op: bool = False) -> "Pending":
        """``out`` ``[B, S, h, Dv]`` (float32 accumulator or the kernel's own result) ->
        ``[B, s, H, Dv]`` in ``dtype`` on the rank that holds those tokens; with ``lse``
        ``[B, h, S]`` also the local ``[B, H, s]`` float lse.  ``q_guard`` (``[B, S, h, 1]``,
        0 or NaN) is added on the way, so rows whose query was not finite come out NaN.
        ``keep_heads``: also return the head-layout output in ``dtype`` (for the backward).
        ``into``/``lse_into``: write this plan's heads into these full-width tensors.

        ``wait()`` returns ``(out, lse or None, out in head layout or None)``."""
        plan, me = self.plan, self.rank
        b, _, h, dv = out.shape
        if self.size == 1:   # nothing travels
            # the result is a new tensor; without a backward the kernel's own (contiguous) output is one
            if q_guard is None and not keep_heads and into is None and out.dtype == dtype and out.is_contiguous():
                local = out
            else:
                local = _convert(out, dtype, q_guard)
            if into is not None:
                a, c = plan.q[0]
                into[:, :, a:c] = local
                local = into
                if lse is not None and lse_into is not None:
                    lse_into[:, a:c] = lse
                    lse = lse_into
            return Done((local, lse, out if keep_heads else None))
        label = "Ulysses all-to-all of the output (forward)"
        codec = self.codecs["out"]
        if lse is None:
            key = ("out", out.shape, out.dtype, dtype)
            route = self._routes.get(key)
            if route is None:
                route = self._routes[key] = self._route_out(out.shape)
            if route and (into is not None or route.tiles):
                return self._start_out_routed(route, out, dtype, q_guard, keep_heads, into, async_op, label)
        if lse is None and codec.identity:
            # the converted output, sequence-major, is the send buffer: chunk u = rows of u
            send = torch.empty((self.total, b, h, dv), dtype=dtype, device=out.device)
            _convert(out, dtype, q_guard, into=send.permute(1, 0, 2, 3))
            chunks, work = self._seq_fast(send, [plan.q[u][1] - plan.q[u][0] for u in range(self.size)], label,
                                          async_op)

            def finish():
                local = self._place_heads([chunks], [plan.q], dv, dtype, out.device,
                                          into=None if into is None else [into])[0]
                return local, None, (send.permute(1, 0, 2, 3) if keep_heads else None)
            return Pending(work, finish, label, self.where)
        conv = _convert(out, dtype, q_guard)
        pieces = codec.encode(conv)
        parts = [_Part(p.permute(1, 0, 2, 3), plan.q) for p in pieces]
        if lse is not None:
            parts.append(_Part(lse.permute(2, 0, 1).unsqueeze(-1), plan.q))
        received, work = self._seq_bytes(parts, label, async_op)

        def finish_bytes():
            got = received()
            res = into if into is not None else \
                torch.empty((b, self.seq_lens[me], plan.num_heads, dv), dtype=dtype, device=out.device)
            for u in range(self.size):   # decode source by source into the full-width output
                a, c = plan.q[u]
                if c > a:
                    res[:, :, a:c] = codec.decode([got[i][u].permute(1, 0, 2, 3) for i in range(len(pieces))], dtype)
            lse_local = None
            if lse is not None:
                lse_local = lse_into if lse_into is not None else \
                    torch.empty((b, plan.num_heads, self.seq_lens[me]), dtype=lse.dtype, device=lse.device)
                for u in range(self.size):
                    a, c = plan.q[u]
                    if c > a:
                        lse_local[:, a:c] = got[-1][u].squeeze(-1).permute(1, 2, 0)
            return res, lse_local, (conv if keep_heads else None)
        return Pending(work, finish_bytes, label, self.where)

    # ------------------------------------------------------------------ backward
    def dout_to_heads(self, dout: torch.Tensor) -> torch.Tensor:
        return self.start_dout(dout).wait()

    def start_dout(self, dout: torch.Tensor, *, async_op: bool = False) -> "Pending":
        """The output gradient, sequence -> heads (full precision whatever the codecs)."""
        plan = self.plan
        if self.size == 1:
            a, c = plan.q[0]
            return Done(dout if (a, c) == (0, dout.shape[2]) else dout.narrow(2, a, c - a))
        label = "Ulysses all-to-all of the output gradient (backward)"
        key = ("dout", dout.shape, dout.dtype)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._route_heads((dout,), (plan.q,))
        if route:
            recv, work = self._send_gathered(route, (dout,), async_op, label)
        else:
            recv, work = self._heads_fast([_Part(dout, plan.q)], async_op, label)
        return Pending(work, lambda: recv.permute(1, 0, 2, 3), label, self.where)

    def grads_to_seq(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dtype: torch.dtype):
        return self.start_grads(dq, dk, dv, dtype).wait()

    def start_grads(self, dq, dk=None, dv=None, dtype: Optional[torch.dtype] = None, *,
                    into=None, async_op: bool = False) -> "Pending":
        """``dq`` ``[B, S, h, D]``, ``dk``/``dv`` ``[B, S, hk_kernel, D]`` (float32
        accumulators, head layout) -> this rank's ``[B, s, H|Hkv, D]`` gradients in
        ``dtype``; gradients of KV heads several ranks used are summed.  ``into``: add this
        plan's heads into these (zero-initialised) full-size tensors instead.

        ``dq`` may be a list ``[dq, dk, dv]`` instead: it is emptied here, so that a caller
        keeping no other reference lets them go once they are packed for the wire (before
        the receive buffer exists)."""
        if isinstance(dq, list):
            holder = dq
            dq, dk, dv = holder
            holder.clear()
            del holder
        plan, me = self.plan, self.rank
        assert dtype is not None and dk is not None and dv is not None
        exp = plan.kv_expand[me]
        if exp is not None:   # repeated KV heads: sum their gradients back to the distinct ones
            a, c = plan.kv[me]
            idx = self._index(dk.device)
            dk = dk.new_zeros(dk.shape[0], dk.shape[1], c - a, dk.shape[3]).index_add_(2, idx, dk)
            dv = dv.new_zeros(dv.shape[0], dv.shape[1], c - a, dv.shape[3]).index_add_(2, idx, dv)
        if self.size == 1:
            if into is None and plan.q[0] == (0, plan.num_heads) and plan.kv[0] == (0, plan.num_kv_heads):
                return Done((dq.to(dtype), dk.to(dtype), dv.to(dtype)))
            b, s = dq.shape[0], dq.shape[1]
            res = into if into is not None else (
                torch.zeros(b, s, plan.num_heads, dq.shape[3], dtype=dtype, device=dq.device),
                torch.zeros(b, s, plan.num_kv_heads, dk.shape[3], dtype=dtype, device=dq.device),
                torch.zeros(b, s, plan.num_kv_heads, dv.shape[3], dtype=dtype, device=dq.device))
            (qa, qc), (ka, kc) = plan.q[0], plan.kv[0]
            res[0][:, :, qa:qc] += dq
            res[1][:, :, ka:kc] += dk
            res[2][:, :, ka:kc] += dv
            return Done(tuple(res))
        label = "Ulysses all-to-all of dq/dk/dv (backward)"
        b, _, hq, d = dq.shape
        hk, dvd = dk.shape[2], dv.shape[3]
        reduce_kv = plan.kv_shared or into is not None
        if dvd == d and dk.shape[3] == d:
            device = dq.device
            send = torch.empty((self.total, b, hq + 2 * hk, d), dtype=dtype, device=device)
            # one launch packs (and converts) all three, sequence-major
            torch.cat((dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)), 2, out=send)
            del dq, dk, dv      # packed: a caller that kept no reference frees them before the receive buffer
            key = ("grads", send.shape, dtype, into is None)
            route = self._routes.get(key)
            if route is None:
                route = self._routes[key] = self._route_grads(b, hq, hk, d, into is None)
            if route:
                return self._start_grads_routed(route, send, dtype, into, async_op, label)
            widths = [(plan.q[u][1] - plan.q[u][0]) + 2 * (plan.kv[u][1] - plan.kv[u][0])
                      for u in range(self.size)]
            recv, work = self._seq_fast(send, widths, label, async_op)

            def finish():
                rq, rk, rv = [], [], []   # split each source's chunk back into its dq, dk, dv heads
                for u, chunk in enumerate(recv):
                    nq, nk = plan.q[u][1] - plan.q[u][0], plan.kv[u][1] - plan.kv[u][0]
                    rq.append(chunk[:, :, :nq])
                    rk.append(chunk[:, :, nq:nq + nk])
                    rv.append(chunk[:, :, nq + nk:])
                gq = self._place_heads([rq], [plan.q], d, dtype, device,
                                       into=None if into is None else [into[0]])[0]
                gk, gv = self._place_heads([rk, rv], [plan.kv, plan.kv], d, dtype, device,
                                           total=plan.num_kv_heads, reduce=reduce_kv,
                                           into=None if into is None else [into[1], into[2]])
                return gq, gk, gv
            return Pending(work, finish, label, self.where)
        parts = [_Part(x.to(dtype).permute(1, 0, 2, 3), plan.q if i == 0 else plan.kv)
                 for i, x in enumerate((dq, dk, dv))]
        got, work = self._seq_bytes(parts, label, async_op)

        def finish_bytes():
            g = got()
            gq = self._place_heads([g[0]], [plan.q], d, dtype, dq.device,
                                   into=None if into is None else [into[0]])[0]
            gk, gv = self._place_heads([g[1], g[2]], [plan.kv, plan.kv], None, dtype, dq.device,
                                       total=plan.num_kv_heads, reduce=reduce_kv,
                                       into=None if into is None else [into[1], into[2]])
            return gq, gk, gv
        return Pending(work, finish_bytes, label, self.where)

    # ------------------------------------------------------------------ routes (steady state)
    def _route_heads(self, xs, rows_per, names: Optional[Sequence[str]] = None):
        """The :class:`_Route` of a sequence -> heads exchange of these tensors (their shapes
        and dtypes), or False when the general path must run: a codec that is not the
        identity (``names``: the tensors' codecs; None: full precision whatever the codecs),
        tensors that cannot share one buffer along heads, or a rank whose heads of some
        tensor do not follow the same pattern as every other rank's (:func:`_regular`)."""
        if names is not None and not all(self.codecs[n].identity for n in names):
            return False
        x0 = xs[0]
        if any(x.dim() != 4 or x.shape[1] != x0.shape[1] for x in xs) or not _homogeneous(xs):
            return False
        b, s, _, d = x0.shape
        views, widths = [], []
        for x, rows in zip(xs, rows_per):
            reg = _regular(rows, x.shape[2])
            if reg is None:
                return False
            off, step, w = reg
            views.append(((self.size, s, b, w, d), off, step))
            widths.append(w)
        return _Route(views, (self.total, b, sum(widths), d), widths)

    def _route_saved(self, xs, rows_per, dout, lse4):
        """For :meth:`saved_to_heads`: the routes of its three sequence -> heads exchanges
        (q/k/v/out, dout, lse; None where that exchange packs per destination,
        :meth:`_heads_fast`), or False when q/k/v/out cannot share one buffer along heads
        (the bytes path)."""
        x0 = xs[0]
        if any(x.dim() != 4 or x.shape[1] != x0.shape[1] for x in xs + (dout,)) or not _homogeneous(xs):
            return False
        q_rows = (self.plan.q,)
        return (self._route_heads(xs, rows_per) or None, self._route_heads((dout,), q_rows) or None,
                self._route_heads((lse4,), q_rows) or None)

    def _gather_heads(self, route, xs, rows_per, label: str) -> torch.Tensor:
        """One blocking sequence -> heads all-to-all of ``xs`` (one dtype and head dim) along
        ``route`` (None: packed per destination): the ``[S, B, W, d]`` receive buffer.  The
        send buffer is gone when this returns."""
        if route is not None:
            recv, work = self._send_gathered(route, xs, False, label)
        else:
            recv, work = self._heads_fast([_Part(x, r) for x, r in zip(xs, rows_per)], False, label)
        wait(label, self.where, work)
        return recv

    def _send_gathered(self, route: "_Route", xs, async_op: bool, label: str,
                       scratch: Optional["_Scratch"] = None, tag: str = ""):
        """Sequence -> heads along a route: every tensor's heads for every destination as one
        strided view (destinations outermost), side by side in ONE copy (``cat``), one
        all-to-all of whole blocks; returns (the ``[S, B, W, d]`` receive buffer, the work).
        With ``scratch`` (a synchronous call whose buffers are dead when it returns), both
        buffers are that thread's reused ones (``tag``: which of a call's exchanges)."""
        views = [_strided(x, size, off, step) for x, (size, off, step) in zip(xs, route.views)]
        if scratch is not None:
            u, s, b, _, d = route.views[0][0]
            dtype = xs[0].dtype
            buf = torch.cat(views, 3, out=scratch.take("send" + tag, (u, s, b, sum(route.widths), d), dtype))
            recv = scratch.take("recv" + tag, route.recv_shape, dtype)
        else:
            buf = torch.cat(views, 3)
            if not buf.is_contiguous():
                buf = buf.contiguous()
            recv = torch.empty(route.recv_shape, dtype=buf.dtype, device=buf.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, buf, self._lens, self._rows_to,
                          group=self.group, async_op=async_op)
        return recv, work

    def _finish_qkv(self, route: "_Route", recv: torch.Tensor):
        qh, kh, vh = recv.permute(1, 0, 2, 3).split_with_sizes(route.widths, 2)
        return self.expand(qh, kh, vh)

    def _route_grads(self, b: int, hq: int, hk: int, d: int, fresh: bool):
        """The :class:`_Route` of the dq/dk/dv heads -> sequence exchange (packed, one head
        dim), or False (the general path): every rank's query heads and KV heads follow one
        pattern each (:func:`_regular`), so every source's block has the same width and the
        receive buffer is ``[U, s, B, hq + 2 hk, d]``.  ``views``: the strided views of the
        results that take dq and dk/dv (``None``: placed source by source); ``add`` when
        dk/dv are added into ``into`` (else copied into a new result)."""
        plan = self.plan
        rq, rk = _regular(plan.q, plan.num_heads), _regular(plan.kv, plan.num_kv_heads)
        if rq is None or rk is None or rq[2] != hq or rk[2] != hk:
            return False
        s_me = self.seq_lens[self.rank]
        views: List[Optional[Tuple]] = []
        for (off, step, w), total in ((rq, plan.num_heads), (rk, plan.num_kv_heads)):
            if fresh:   # a new result: the ranks' heads must tile it in rank order
                ok = off == 0 and step == w and self.size * w == total
            else:       # into ``into``: one strided view needs the ranks' heads apart
                ok = step >= w
            views.append(((self.size, s_me, b, w, d), off, step) if ok else None)
        route = _Route(views, (self.size, s_me, b, hq + 2 * hk, d), [hq, hk, hk])
        route.result_shape = (b, s_me)
        route.add = not fresh
        return route

    def _start_grads_routed(self, route: "_Route", send, dtype, into, async_op: bool, label: str) -> "Pending":
        """:meth:`start_grads` along a route: one all-to-all of whole blocks; dq lands with
        one strided copy, dk and dv with one strided copy (a new result) or add (into
        ``into``) each, or source by source where the ranks' heads overlap."""
        plan = self.plan
        recv = torch.empty(route.recv_shape, dtype=dtype, device=send.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, send, self._rows_to, self._lens,
                          group=self.group, async_op=async_op)
        del send

        def finish():
            b, s_me = route.result_shape
            d = route.recv_shape[-1]
            parts = recv.split_with_sizes(route.widths, 3)     # each [U, s, B, w, d]
            qv, kv = route.views
            res = []
            for i, (part, view) in enumerate(zip(parts, (qv, kv, kv))):
                n = plan.num_heads if i == 0 else plan.num_kv_heads
                target = into[i] if into is not None else None
                if view is None:       # overlapping heads (summed) or no single pattern: source by source
                    rows = plan.q if i == 0 else plan.kv
                    res.append(self._place_heads([list(part.unbind(0))], [rows], d, dtype, recv.device,
                                                 total=n, reduce=i > 0 and (plan.kv_shared or into is not None),
                                                 into=None if target is None else [target])[0])
                    continue
                if target is None:
                    target = torch.empty((b, s_me, n, d), dtype=dtype, device=recv.device)
                size, off, step = view
                dst = _strided(target, size, off, step)
                if i > 0 and route.add:
                    dst.add_(part)     # KV heads of several groups add up in ``into``
                else:
                    dst.copy_(part)
                res.append(target)
            return tuple(res)
        return Pending(work, finish, label, self.where)

    def _route_out(self, shape):
        """The :class:`_Route` of the output's heads -> sequence exchange (identity codec,
        no lse) for an output ``[B, S, h, Dv]`` of this shape, or False (the general path)."""
        if not self.codecs["out"].identity or len(shape) != 4:
            return False
        plan = self.plan
        reg = _regular(plan.q, plan.num_heads)
        if reg is None:
            return False
        off, step, w = reg
        b, S, h, dv = shape
        if step < w or h != w or S != self.total:
            return False
        s_me = self.seq_lens[self.rank]
        shape = (self.size, s_me, b, w, dv)
        route = _Route([(shape, off, step)], shape, None)
        route.result_shape = (b, s_me, plan.num_heads, dv)
        route.tiles = off == 0 and step == w and self.size * w == plan.num_heads
        return route

    def _start_out_routed(self, route: "_Route", out, dtype, q_guard, keep_heads: bool, into, async_op: bool,
                          label: str) -> "Pending":
        """:meth:`start_out` along a route: the output in ``dtype``, sequence-major, is the
        send buffer (the kernel's own output when it already is that: same dtype, no guard,
        ``[S, B]`` contiguous); the receive buffer, destinations outermost, lands in the
        result with one copy (a new ``[B, s, H, Dv]``, or this plan's heads of ``into``)."""
        if q_guard is None and out.dtype == dtype:
            send = out.transpose(0, 1)
            if not send.is_contiguous():
                send = send.contiguous()
        else:
            b, _, h, dv = out.shape
            send = torch.empty((self.total, b, h, dv), dtype=dtype, device=out.device)
            _convert(out, dtype, q_guard, into=send.permute(1, 0, 2, 3))
        recv = torch.empty(route.recv_shape, dtype=dtype, device=out.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, send, self._rows_to, self._lens,
                          group=self.group, async_op=async_op)

        def finish():
            # a new tensor (never a view: the caller may return it from an autograd Function
            # and have it modified in place), or this plan's heads of ``into``
            local = torch.empty(route.result_shape, dtype=dtype, device=out.device) if into is None else into
            (size, off, step), = route.views
            _strided(local, size, off, step).copy_(recv)
            return local, None, (send.permute(1, 0, 2, 3) if keep_heads else None)
        return Pending(work, finish, label, self.where)

    # ------------------------------------------------------------------ the collectives
    def _heads_fast(self, parts: List[_Part], async_op: bool, label: str):
        """Same dtype and head dim: per destination, the parts' heads side by side."""
        x0 = parts[0].data
        b, s_me, _, d = x0.shape
        U = self.size
        even = [_even_width(p.heads, p.data.shape[2], U) for p in parts]
        widths_even = [w for w in even if w is not None]
        if len(widths_even) == len(parts):   # every part split evenly: one strided copy per part
            W = sum(widths_even)
            buf = torch.empty((U, s_me, b, W, d), dtype=x0.dtype, device=x0.device)
            h0 = 0
            for p, w in zip(parts, widths_even):
                buf[:, :, :, h0:h0 + w].copy_(p.data.unflatten(2, (U, w)).permute(2, 1, 0, 3, 4))
                h0 += w
            recv = torch.empty((self.total, b, W, d), dtype=x0.dtype, device=x0.device)
            work = collective(label, self.where, dist.all_to_all_single, recv.view(-1), buf.view(-1),
                              [n * b * W * d for n in self.seq_lens], [s_me * b * W * d] * U,
                              group=self.group, async_op=async_op)
            return recv, work
        widths = [sum(p.heads[u][1] - p.heads[u][0] for p in parts) for u in range(self.size)]
        send = torch.empty(sum(s_me * b * w * d for w in widths), dtype=x0.dtype, device=x0.device)
        off = 0
        for u in range(self.size):
            n = s_me * b * widths[u] * d
            if n:
                blk = send.narrow(0, off, n).view(s_me, b, widths[u], d)
                h0 = 0
                for p in parts:
                    a, c = p.heads[u]
                    if c > a:
                        blk[:, :, h0:h0 + c - a].copy_(p.data[:, :, a:c].transpose(0, 1))
                        h0 += c - a
            off += n
        me_w = widths[self.rank]
        recv = torch.empty((self.total, b, me_w, d), dtype=x0.dtype, device=x0.device)
        work = collective(label, self.where, dist.all_to_all_single, recv.view(-1), send,
                          [n * b * me_w * d for n in self.seq_lens], [s_me * b * w * d for w in widths],
                          group=self.group, async_op=async_op)
        return recv, work

    def _heads_bytes(self, parts: List[_Part], async_op: bool, label: str):
        """Any dtypes and head dims: every part of every destination as bytes, one buffer."""
        me = self.rank
        x0 = parts[0].data
        b, s_me = x0.shape[0], x0.shape[1]
        send_sizes: List[int] = []
        for u in range(self.size):
            size = 0
            for p in parts:
                a, c = p.heads[u]
                size += wire.aligned(wire.nbytes((s_me, b, c - a, p.data.shape[3]), p.data.dtype))
            send_sizes.append(size)
        send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=x0.device)
        off = 0
        for u in range(self.size):
            for p in parts:
                a, c = p.heads[u]
                shape = (s_me, b, c - a, p.data.shape[3])
                if c > a:
                    wire.typed(send, off, shape, p.data.dtype).copy_(p.data[:, :, a:c].transpose(0, 1))
                off += wire.aligned(wire.nbytes(shape, p.data.dtype))
        recv_sizes = []
        for u in range(self.size):
            size = 0
            for p in parts:
                a, c = p.heads[me]
                size += wire.aligned(wire.nbytes((self.seq_lens[u], b, c - a, p.data.shape[3]), p.data.dtype))
            recv_sizes.append(size)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=x0.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, send, recv_sizes, send_sizes,
                          group=self.group, async_op=async_op)

        def unpack():
            outs = []
            for p in parts:
                a, c = p.heads[me]
                outs.append(torch.empty((self.total, b, c - a, p.data.shape[3]), dtype=p.data.dtype,
                                        device=x0.device))
            off = 0
            for u in range(self.size):
                rows = slice(self.offsets[u], self.offsets[u] + self.seq_lens[u])
                for o in outs:
                    shape = (self.seq_lens[u], b, o.shape[2], o.shape[3])
                    if o.shape[2]:
                        o[rows].copy_(wire.typed(recv, off, shape, o.dtype))
                    off += wire.aligned(wire.nbytes(shape, o.dtype))
            return outs
        return unpack, work

    def _seq_fast(self, send: torch.Tensor, widths: List[int], label: str, async_op: bool = False):
        """``send`` ``[S, B, w, d]`` (sequence-major, contiguous): rows of rank ``u`` go to
        ``u``; returns (each source's ``[s_me, B, widths[u], d]`` chunk as views of one
        buffer, the work handle or None)."""
        me = self.rank
        _, b, w_me, d = send.shape
        s_me = self.seq_lens[me]
        recv = torch.empty(sum(s_me * b * w * d for w in widths), dtype=send.dtype, device=send.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, send.view(-1),
                          [s_me * b * w * d for w in widths], [n * b * w_me * d for n in self.seq_lens],
                          group=self.group, async_op=async_op)
        chunks, off = [], 0
        for w in widths:
            n = s_me * b * w * d
            chunks.append(recv.narrow(0, off, n).view(s_me, b, w, d))
            off += n
        return chunks, work

    def _seq_bytes(self, parts: List[_Part], label: str, async_op: bool = False):
        """Parts ``[S, B, h_me, d]`` (any dtypes; ``heads[u]``: the head range rank ``u``
        holds of that part): rows of rank ``u`` go to ``u`` as bytes.  Returns (a function
        giving, per part, each source's ``[s_me, B, h_u, d]`` chunk; the work handle)."""
        me = self.rank
        s_me = self.seq_lens[me]
        b = parts[0].data.shape[1]
        send_sizes = []
        for u in range(self.size):
            send_sizes.append(sum(wire.aligned(wire.nbytes((self.seq_lens[u],) + tuple(p.data.shape[1:]), p.data.dtype))
                                  for p in parts))
        dev = parts[0].data.device
        send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=dev)
        off = 0
        for u in range(self.size):
            rows = slice(self.offsets[u], self.offsets[u] + self.seq_lens[u])
            for p in parts:
                shape = (self.seq_lens[u],) + tuple(p.data.shape[1:])
                if self.seq_lens[u]:
                    wire.typed(send, off, shape, p.data.dtype).copy_(p.data[rows])
                off += wire.aligned(wire.nbytes(shape, p.data.dtype))
        recv_sizes, shapes = [], []
        for u in range(self.size):
            size, row = 0, []
            for p in parts:
                a, c = p.heads[u]
                shape = (s_me, b, c - a, p.data.shape[3])
                row.append(shape)
                size += wire.aligned(wire.nbytes(shape, p.data.dtype))
            recv_sizes.append(size)
            shapes.append(row)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
        work = collective(label, self.where, dist.all_to_all_single, recv, send, recv_sizes, send_sizes,
                          group=self.group, async_op=async_op)

        def unpack():
            out = [[None] * self.size for _ in parts]
            o = 0
            for u in range(self.size):
                for i, p in enumerate(parts):
                    out[i][u] = wire.typed(recv, o, shapes[u][i], p.data.dtype)
                    o += wire.aligned(wire.nbytes(shapes[u][i], p.data.dtype))
            return out
        return unpack, work

    def _place_heads(self, per_part_chunks, rows_per_part, d, dtype, device, *, total=None, reduce=False,
                     into=None):
        """Per part, put each source's ``[s, B, h_u, d]`` chunk at its global heads of a
        ``[B, s, H, d]`` result (summing where several sources sent the same head, and
        always summing into ``into`` tensors when given with ``reduce``)."""
        me = self.rank
        s_me = self.seq_lens[me]
        results = []
        for i, (chunks, rows) in enumerate(zip(per_part_chunks, rows_per_part)):
            b = chunks[0].shape[1]
            dd = chunks[0].shape[3] if d is None else d
            n_heads = total if total is not None else self.plan.num_heads
            if into is not None:
                res = into[i]
            else:
                res = (torch.zeros if reduce else torch.empty)((b, s_me, n_heads, dd), dtype=dtype, device=device)
            w = _even_width(rows, n_heads, len(chunks))
            whole = None if reduce or w is None or len(chunks) < 2 else _adjacent(chunks)
            if whole is not None:      # the sources' chunks tile one buffer: one strided copy
                res.unflatten(2, (len(chunks), w)).copy_(whole.permute(2, 1, 0, 3, 4))
                results.append(res)
                continue
            for u, chunk in enumerate(chunks):
                a, c = rows[u]
                if c > a:
                    if reduce:
                        res[:, :, a:c] += chunk.permute(1, 0, 2, 3)
                    else:
                        res[:, :, a:c].copy_(chunk.permute(1, 0, 2, 3))
            results.append(res)
        return results


class Done(Pending):
    """An exchange that needed no communication (a group of one)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _Scratch(threading.local):
    """One thread's reused CPU buffers for the synchronous exchanges of bound forward calls
    (:meth:`UlyssesExchange.bind_forward`), keyed by role, shape and dtype and shared by every
    exchange on the thread (a model's layers of one shape share one pair).

    Why: the CPU has no caching allocator.  A fresh send or receive buffer of several MiB per
    call is handed back to the OS when freed and comes back as new pages, one page fault per
    4 KiB: at Ulysses-2, S=4096 (12 MiB each way per rank) about 1,000-2,000 minor faults and
    1-2% of the call (``benchmarks/peer_steady.py --ulysses --seqlen 4096``).  Accelerators'
    caching allocators already reuse their blocks, so only CPU calls take this.

    At most :attr:`KEEP_BYTES` stay held per thread, the least recently used going first; a
    buffer larger than that is never held.  :meth:`clear` lets them go."""

    KEEP_BYTES = 256 << 20

    def __init__(self):
        self.bufs: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self.held = 0

    def take(self, role: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """The thread's ``role`` buffer of ``shape`` and ``dtype`` (uninitialised when new)."""
        key = (role, tuple(shape), dtype)
        buf = self.bufs.get(key)
        if buf is not None:
            self.bufs.move_to_end(key)
            return buf
        buf = torch.empty(key[1], dtype=dtype)
        size = buf.numel() * buf.element_size()
        if size > self.KEEP_BYTES:
            return buf
        self.bufs[key] = buf
        self.held += size
        while self.held > self.KEEP_BYTES:
            _, old = self.bufs.popitem(last=False)
            self.held -= old.numel() * old.element_size()
        return buf

    def clear(self) -> None:
        self.bufs.clear()
        self.held = 0


_SCRATCH = _Scratch()


class _Route:
    """What one exchange does for given shapes and dtypes, worked out once per exchange.

    ``views``: per tensor, ``(size, off, step)``: the ``[U, s, B, w, d]`` strided view of
    the ``[B, s, H, d]`` tensor (``H`` its heads) whose ``u``-th block holds heads ``off +
    u * step`` .. ``+ w`` (see :func:`_strided`); ``recv_shape``: the receive buffer;
    ``widths``: per tensor, the heads each rank receives (sequence -> heads).  For the
    output (heads -> sequence): ``result_shape``, and ``tiles`` when the ranks' heads tile
    ``[0, H)`` in rank order (the result can be a new tensor rather than ``into``).  For the
    gradients (heads -> sequence): ``add`` when dk/dv are added into ``into``.
    """

    __slots__ = ("views", "recv_shape", "widths", "result_shape", "tiles", "add")

    def __init__(self, views, recv_shape, widths):
        self.views, self.recv_shape, self.widths = views, recv_shape, widths
        self.result_shape: Tuple[int, ...] = ()
        self.tiles = False
        self.add = False


def _regular(rows, total: int) -> Optional[Tuple[int, int, int]]:
    """``(off, step, w)`` when rank ``u`` holds heads ``off + u * step`` .. ``+ w`` of
    ``total`` (``w > 0``; ``step`` 0 when every rank holds the same heads): the pattern one
    strided view takes.  None otherwise (uneven counts, a rank without heads)."""
    a0, c0 = rows[0]
    w = c0 - a0
    step = rows[1][0] - a0 if len(rows) > 1 else 0
    if w <= 0 or step < 0 or a0 < 0 or a0 + (len(rows) - 1) * step + w > total:
        return None
    for u, (a, c) in enumerate(rows):
        if a != a0 + u * step or c != a + w:
            return None
    return a0, step, w


def _strided(x: torch.Tensor, size, off: int, step: int) -> torch.Tensor:
    """The ``[U, s, B, w, d]`` view ``size`` of ``x`` ``[B, s, H, d]`` (any strides) whose
    block ``u`` is heads ``off + u * step`` .. ``+ w``, sequence-major."""
    sb, ss, sh, sd = x.stride()
    return x.as_strided(size, (step * sh, ss, sb, sh, sd), x.storage_offset() + off * sh)


def _even_width(rows, total: int, size: int) -> Optional[int]:
    """``w`` when rank ``u`` holds heads ``u*w .. (u+1)*w`` of ``total = size*w`` (an even split)."""
    if total % size:
        return None
    w = total // size
    return w if w and all(tuple(rows[u]) == (u * w, (u + 1) * w) for u in range(size)) else None


def _adjacent(chunks) -> Optional[torch.Tensor]:
    """``[n, *shape]``: the equal, contiguous chunks as one view when each follows the last in memory."""
    c0 = chunks[0]
    if not all(c.is_contiguous() and c.shape == c0.shape and c.dtype == c0.dtype for c in chunks):
        return None
    step = c0.numel() * c0.element_size()
    base = c0.data_ptr()
    if any(c.data_ptr() != base + u * step for u, c in enumerate(chunks)):
        return None
    return c0.as_strided((len(chunks), *c0.shape), (c0.numel(), *c0.stride()))


def _homogeneous(tensors) -> bool:
    t0 = tensors[0]
    return all(t.dtype == t0.dtype and t.shape[3] == t0.shape[3] and t.shape[0] == t0.shape[0] for t in tensors)


def _convert(x: torch.Tensor, dtype: torch.dtype, guard: Optional[torch.Tensor], into=None) -> torch.Tensor:
    """``x`` in ``dtype`` (a new tensor, or written into ``into``), plus ``guard`` if given."""
    if guard is None:
        if into is None:
            return x.to(dtype, copy=True)
        into.copy_(x)
        return into
    if into is None:
        into = torch.empty(x.shape, dtype=dtype, device=x.device)
    torch.add(x, guard, out=into)
    return into
