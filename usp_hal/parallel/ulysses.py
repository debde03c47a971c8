"""The Ulysses exchange: one all-to-all from sequence shards to head shards and one back.

Every tensor travels *sequence-major*: rank ``u`` sends each peer the heads that peer
computes, for all of its own tokens, as ``[s_u, B, h, D]``.  The receive buffer is then
``[S, B, h, D]`` with the sources in sequence order, which *is* the gathered sequence:
no reassembly copy.

**One path each way.**  Sequence -> heads (:meth:`UlyssesExchange._to_heads`): per
destination, the heads it computes of every tensor of the exchange side by side (q, k and v
together, with their own head counts under GQA), one all-to-all; q, k, v are views of the
receive buffer.  When every tensor's heads follow one pattern across the ranks (an even
split), the packing is one strided copy for all of them.  Heads -> sequence
(:meth:`UlyssesExchange._to_seq`): the head-layout tensor, sequence-major, is the send
buffer; each source's block lands at its heads with one strided copy when the ranks' heads
follow one pattern.  dq, dk and dv travel back together the same way.

**Bytes.**  Tensors that cannot share one buffer along heads (different head dims or dtypes,
or a wire codec that turns a tensor into several parts, ``usp_hal.parallel.codec``) travel as bytes,
every part of every destination in one all-to-all.

Which heads each rank computes is :mod:`usp_hal.parallel.heads` (re-exported here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import wire
from .codec import IDENTITY
from .comm import collective, wait
from .heads import HeadPlan, head_plan, most_groups, split_plan

__all__ = ["HeadPlan", "head_plan", "most_groups", "split_plan", "UlyssesExchange", "Pending", "Done"]


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


class Done(Pending):
    """An exchange that needed no communication (a group of one)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class UlyssesExchange:
    """Sequence <-> heads all-to-alls over one Ulysses group for one call's shapes.

    ``seq_lens[u]``: tokens rank ``u`` holds (uneven allowed); ``plan``: the heads each
    rank computes.  ``codecs`` maps ``"q"``, ``"k"``, ``"v"``, ``"out"`` to a wire codec.
    """

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
        self.codecs = {**{name: IDENTITY for name in ("q", "k", "v", "out")}, **(codecs or {})}
        self._expand = plan.kv_expand[rank] if 0 <= rank < plan.size else None
        self._expand_idx: dict = {}             # device -> the index tensor of ``_expand``

    def _width(self, rows, u: int = -1) -> int:
        a, c = rows[self.rank if u < 0 else u]
        return c - a

    # ------------------------------------------------------------------ sequence -> heads
    def start_qkv(self, q, k, v, *, async_op: bool = False, what: str = "forward") -> Pending:
        """Start sending q, k, v ([B, s, H|Hkv, D], this rank's tokens) to the ranks that
        compute their heads; ``wait()`` gives ``(qh, kh, vh)`` ``[B, S, h, D]`` views."""
        plan = self.plan
        if self.size == 1:
            return Done(self._local_qkv(q, k, v))
        label = f"Ulysses all-to-all of q/k/v ({what})"
        rows = (plan.q, plan.kv, plan.kv)
        codecs = [self.codecs[n] for n in ("q", "k", "v")]
        if all(c.identity for c in codecs) and _homogeneous([q, k, v]):
            recv, work = self._to_heads((q, k, v), rows, async_op, label)
            hq, hk = self._width(plan.q), self._width(plan.kv)

            def finish():
                qh, kh, vh = recv.permute(1, 0, 2, 3).split_with_sizes((hq, hk, hk), 2)
                return self.expand(qh, kh, vh)
            return Pending(work, finish, label, self.where)
        parts, slots = [], []
        for x, r, codec in zip((q, k, v), rows, codecs):
            pieces = codec.encode(x)
            slots.append((codec, len(pieces), x.dtype))
            parts += [_Part(p, r) for p in pieces]
        unpack, work = self._heads_bytes(parts, async_op, label)

        def finish_bytes():
            got, i = [], 0
            outs = unpack()
            for codec, n, dtype in slots:
                got.append(codec.decode([o.permute(1, 0, 2, 3) for o in outs[i:i + n]], dtype))
                i += n
            return self.expand(*got)
        return Pending(work, finish_bytes, label, self.where)

    def start_heads(self, x: torch.Tensor, kind: str, *, async_op: bool = False,
                    what: str = "forward", name: Optional[str] = None) -> Pending:
        """One tensor, sequence -> heads (``kind`` "q" or "kv": which heads travel where;
        ``name`` "q", "k" or "v": which wire codec applies, none for another name or None).
        ``wait()`` gives ``[B, S, h,
        D]`` (KV heads not yet repeated for cut groups); the Pending's ``result`` is that
        tensor already (filled once ``wait()`` returns)."""
        rows = self.plan.q if kind == "q" else self.plan.kv
        if self.size == 1:
            a, c = rows[0]
            done = Done(x if (a, c) == (0, x.shape[2]) else x.narrow(2, a, c - a))
            done.result = done.value
            return done
        label = f"Ulysses all-to-all of {name or kind} ({what})"
        codec = self.codecs.get(name or "", IDENTITY)
        if codec.identity:
            recv, work = self._to_heads((x,), (rows,), async_op, label)
            res = recv.permute(1, 0, 2, 3)
            p = Pending(work, lambda: res, label, self.where)
            p.result = res
            return p
        pieces = codec.encode(x)
        unpack, work = self._heads_bytes([_Part(t, rows) for t in pieces], async_op, label)
        result = torch.empty((x.shape[0], self.total, self._width(rows), x.shape[3]), dtype=x.dtype,
                             device=x.device)

        def finish():
            result.copy_(codec.decode([o.permute(1, 0, 2, 3) for o in unpack()], x.dtype))
            return result
        p = Pending(work, finish, label, self.where)
        p.result = result
        return p

    def start_dout(self, dout: torch.Tensor, *, async_op: bool = False) -> Pending:
        """The output gradient, sequence -> heads (full precision whatever the codecs)."""
        return self.start_heads(dout, "q", async_op=async_op, what="backward", name="output gradient")

    def saved_to_heads(self, q, k, v, out, dout, lse):
        """Everything a backward needs, in the head layout: ``(qh, kh, vh, outh, douth,
        lse_h)`` with KV heads repeated for cut groups and ``lse_h`` ``[B, h, S]`` (``lse`` is
        the local ``[B, H, s]``).

        q, k, v and out of one dtype and head dim travel in one all-to-all (views of its
        receive buffer back), dout in a second, the lse in a third; else all as bytes in one."""
        plan = self.plan
        if self.size == 1:
            kh, vh = self._local_qkv(q, k, v)[1:]
            return q, kh, vh, out, dout, lse
        lse4 = lse.transpose(1, 2).unsqueeze(-1)            # [B, s, H, 1]
        label = "Ulysses all-to-all of q/k/v/out/dout/lse (compiled backward)"
        xs, rows = (q, k, v, out), (plan.q, plan.kv, plan.kv, plan.q)
        if _homogeneous(xs):
            got = []
            for ts, rs in ((xs, rows), ((dout,), (plan.q,)), ((lse4,), (plan.q,))):
                recv, work = self._to_heads(ts, rs, False, label)
                wait(label, self.where, work)
                got.append(recv.permute(1, 0, 2, 3))
            hq, hk = self._width(plan.q), self._width(plan.kv)
            qh, kh, vh, oh = got[0].split_with_sizes((hq, hk, hk, hq), 2)
            qh, kh, vh = self.expand(qh, kh, vh)
            return qh, kh, vh, oh, got[1], got[2].squeeze(-1).transpose(1, 2).contiguous()
        parts = [_Part(x, r) for x, r in zip(xs + (dout, lse4), rows + (plan.q, plan.q))]
        unpack, work = self._heads_bytes(parts, False, label)
        wait(label, self.where, work)
        qh, kh, vh, oh, dh, lh = (t.permute(1, 0, 2, 3) for t in unpack())
        qh, kh, vh = self.expand(qh, kh, vh)
        return qh, kh, vh, oh, dh, lh.squeeze(-1).transpose(1, 2).contiguous()

    def _local_qkv(self, q, k, v):     # one Ulysses rank: nothing travels, so no codec applies
        a, b = self.plan.kv[0]
        if (a, b) != (0, k.shape[2]):
            k, v = k.narrow(2, a, b - a), v.narrow(2, a, b - a)
        return self.expand(q, k, v)

    def expand(self, qh, kh, vh):
        """Repeat KV heads for a rank whose query heads cut a GQA group (else as they are)."""
        if self._expand is not None:
            idx = self._index(kh.device)
            kh, vh = kh.index_select(2, idx), vh.index_select(2, idx)
        return qh, kh, vh

    def _index(self, device) -> torch.Tensor:
        """``kv_expand`` of this rank as a long tensor on ``device`` (built once per device)."""
        if device not in self._expand_idx:
            self._expand_idx[device] = torch.tensor(self._expand, dtype=torch.long, device=device)
        return self._expand_idx[device]

    # ------------------------------------------------------------------ heads -> sequence
    def start_out(self, out: torch.Tensor, dtype: torch.dtype, lse: Optional[torch.Tensor] = None,
                  q_guard: Optional[torch.Tensor] = None, *, keep_heads: bool = False, into=None,
                  lse_into=None, async_op: bool = False) -> Pending:
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
        if lse is None and codec.identity:
            # the output in ``dtype``, sequence-major, is the send buffer (the kernel's own
            # output when it already is that: same dtype, no guard, [S, B] contiguous)
            send = out.transpose(0, 1)
            if q_guard is not None or out.dtype != dtype or not send.is_contiguous():
                send = torch.empty((self.total, b, h, dv), dtype=dtype, device=out.device)
                _convert(out, dtype, q_guard, into=send.permute(1, 0, 2, 3))
            recv, work = self._to_seq(send, [self._width(plan.q, u) for u in range(self.size)], label, async_op)

            def finish():
                local = _place(recv, plan.q, plan.num_heads, dv, dtype, into=into)
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

    def start_grads(self, dq, dk=None, dv=None, dtype: Optional[torch.dtype] = None, *,
                    into=None, async_op: bool = False) -> Pending:
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
        if plan.kv_expand[me] is not None:   # repeated KV heads: sum their gradients back to the distinct ones
            a, c = plan.kv[me]
            idx = self._index(dk.device)
            dk = dk.new_zeros(dk.shape[0], dk.shape[1], c - a, dk.shape[3]).index_add_(2, idx, dk)
            dv = dv.new_zeros(dv.shape[0], dv.shape[1], c - a, dv.shape[3]).index_add_(2, idx, dv)
        ins = [None, None, None] if into is None else list(into)
        rows3 = (plan.q, plan.kv, plan.kv)
        totals = (plan.num_heads, plan.num_kv_heads, plan.num_kv_heads)
        if self.size == 1:
            if into is None and plan.q[0] == (0, plan.num_heads) and plan.kv[0] == (0, plan.num_kv_heads):
                return Done((dq.to(dtype), dk.to(dtype), dv.to(dtype)))
            return Done(tuple(_place([g.transpose(0, 1)], r, n, g.shape[3], dtype, into=t, reduce=True)
                              for g, r, n, t in zip((dq, dk, dv), rows3, totals, ins)))
        label = "Ulysses all-to-all of dq/dk/dv (backward)"
        b, _, hq, d = dq.shape
        reduce_kv = plan.kv_shared or into is not None
        if dv.shape[3] == d and dk.shape[3] == d:
            hk = dk.shape[2]
            send = torch.empty((self.total, b, hq + 2 * hk, d), dtype=dtype, device=dq.device)
            # one launch packs (and converts) all three, sequence-major
            torch.cat((dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)), 2, out=send)
            del dq, dk, dv      # packed: a caller that kept no reference frees them before the receive buffer
            nq = [self._width(plan.q, u) for u in range(self.size)]
            nk = [self._width(plan.kv, u) for u in range(self.size)]
            recv, work = self._to_seq(send, [a + 2 * c for a, c in zip(nq, nk)], label, async_op)
            del send

            def finish():
                if isinstance(recv, torch.Tensor):       # every source's block of one width
                    parts = recv.split_with_sizes((nq[0], nk[0], nk[0]), 3)
                else:
                    parts = list(zip(*(c.split_with_sizes((x, y, y), 2) for c, x, y in zip(recv, nq, nk))))
                return tuple(_place(x, r, n, d, dtype, into=t, reduce=into is not None if i == 0 else reduce_kv)
                             for i, (x, r, n, t) in enumerate(zip(parts, rows3, totals, ins)))
            return Pending(work, finish, label, self.where)
        parts = [_Part(x.to(dtype).permute(1, 0, 2, 3), r) for x, r in zip((dq, dk, dv), rows3)]
        got, work = self._seq_bytes(parts, label, async_op)

        def finish_bytes():
            return tuple(_place(g, r, n, x.data.shape[3], dtype, into=t, reduce=i > 0 and reduce_kv)
                         for i, (g, x, r, n, t) in enumerate(zip(got(), parts, rows3, totals, ins)))
        return Pending(work, finish_bytes, label, self.where)

    # ------------------------------------------------------------------ the collectives
    def _to_heads(self, xs, rows_per, async_op: bool, label: str):
        """Sequence -> heads of tensors of one dtype and head dim: per destination, each
        tensor's heads for it side by side, in one all-to-all.  When every tensor's heads
        follow one pattern (:func:`_regular`), the packing is one copy (``cat`` of strided
        views, destinations outermost); else destination by destination.  Returns (the
        ``[S, B, W, d]`` receive buffer, the work)."""
        x0 = xs[0]
        b, s_me, _, d = x0.shape
        U = self.size
        widths = [sum(r[u][1] - r[u][0] for r in rows_per) for u in range(U)]
        regs = [_regular(r, x.shape[2]) for x, r in zip(xs, rows_per)]
        if all(r is not None for r in regs):
            views = [_strided(x, (U, s_me, b, w, d), off, step) for x, (off, step, w) in zip(xs, regs)]  # type: ignore[misc]
            send = torch.cat(views, 3) if len(views) > 1 else views[0].contiguous()
        else:
            send = torch.empty(s_me * b * sum(widths) * d, dtype=x0.dtype, device=x0.device)
            off = 0
            for u in range(U):
                blk = send.narrow(0, off, s_me * b * widths[u] * d).view(s_me, b, widths[u], d)
                h0 = 0
                for x, rows in zip(xs, rows_per):
                    a, c = rows[u]
                    if c > a:
                        blk[:, :, h0:h0 + c - a].copy_(x[:, :, a:c].transpose(0, 1))
                        h0 += c - a
                off += blk.numel()
        w_me = widths[self.rank]
        recv = torch.empty((self.total, b, w_me, d), dtype=x0.dtype, device=x0.device)
        work = collective(label, self.where, dist.all_to_all_single, recv.view(-1), send.view(-1),
                          [n * b * w_me * d for n in self.seq_lens], [s_me * b * w * d for w in widths],
                          group=self.group, async_op=async_op)
        return recv, work

    def _to_seq(self, send: torch.Tensor, widths: List[int], label: str, async_op: bool = False):
        """``send`` ``[S, B, w, d]`` (sequence-major, contiguous): rows of rank ``u`` go to
        ``u``; returns (the received blocks: one ``[U, s_me, B, w, d]`` tensor when every
        source sent ``w`` heads, else each source's ``[s_me, B, widths[u], d]``; the work)."""
        _, b, w_me, d = send.shape
        s_me = self.seq_lens[self.rank]
        recv = torch.empty(s_me * b * sum(widths) * d, dtype=send.dtype, device=send.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, send.view(-1),
                          [s_me * b * w * d for w in widths], [n * b * w_me * d for n in self.seq_lens],
                          group=self.group, async_op=async_op)
        if len(set(widths)) == 1:
            return recv.view(self.size, s_me, b, widths[0], d), work
        chunks, off = [], 0
        for w in widths:
            chunks.append(recv.narrow(0, off, s_me * b * w * d).view(s_me, b, w, d))
            off += s_me * b * w * d
        return chunks, work

    def _heads_bytes(self, parts: List[_Part], async_op: bool, label: str):
        """Any dtypes and head dims: every part of every destination as bytes, one buffer."""
        me = self.rank
        x0 = parts[0].data
        b, s_me = x0.shape[0], x0.shape[1]

        def size(n: int, heads_of: int) -> int:
            return sum(wire.aligned(wire.nbytes((n, b, self._width(p.heads, heads_of), p.data.shape[3]),
                                                p.data.dtype)) for p in parts)
        send_sizes = [size(s_me, u) for u in range(self.size)]
        send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=x0.device)
        off = 0
        for u in range(self.size):
            for p in parts:
                a, c = p.heads[u]
                shape = (s_me, b, c - a, p.data.shape[3])
                if c > a:
                    wire.typed(send, off, shape, p.data.dtype).copy_(p.data[:, :, a:c].transpose(0, 1))
                off += wire.aligned(wire.nbytes(shape, p.data.dtype))
        recv_sizes = [size(self.seq_lens[u], me) for u in range(self.size)]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=x0.device)
        work = collective(label, self.where, dist.all_to_all_single, recv, send, recv_sizes, send_sizes,
                          group=self.group, async_op=async_op)

        def unpack():
            outs = [torch.empty((self.total, b, self._width(p.heads), p.data.shape[3]), dtype=p.data.dtype,
                                device=x0.device) for p in parts]
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

    def _seq_bytes(self, parts: List[_Part], label: str, async_op: bool = False):
        """Parts ``[S, B, h_me, d]`` (any dtypes; ``heads[u]``: the head range rank ``u``
        holds of that part): rows of rank ``u`` go to ``u`` as bytes.  Returns (a function
        giving, per part, each source's ``[s_me, B, h_u, d]`` chunk; the work handle)."""
        s_me = self.seq_lens[self.rank]
        b = parts[0].data.shape[1]
        send_sizes = [sum(wire.aligned(wire.nbytes((n,) + tuple(p.data.shape[1:]), p.data.dtype)) for p in parts)
                      for n in self.seq_lens]
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
        shapes = [[(s_me, b, self._width(p.heads, u), p.data.shape[3]) for p in parts] for u in range(self.size)]
        recv_sizes = [sum(wire.aligned(wire.nbytes(sh, p.data.dtype)) for sh, p in zip(row, parts)) for row in shapes]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
        work = collective(label, self.where, dist.all_to_all_single, recv, send, recv_sizes, send_sizes,
                          group=self.group, async_op=async_op)

        def unpack():
            out: List[list] = [[None] * self.size for _ in parts]
            o = 0
            for u in range(self.size):
                for i, p in enumerate(parts):
                    out[i][u] = wire.typed(recv, o, shapes[u][i], p.data.dtype)
                    o += wire.aligned(wire.nbytes(shapes[u][i], p.data.dtype))
            return out
        return unpack, work


def _place(src, rows, total: int, d: int, dtype, *, into=None, reduce: bool = False) -> torch.Tensor:
    """Each source ``u``'s ``[s, B, h_u, d]`` block (``src[u]``) at its global heads
    ``rows[u]`` of a ``[B, s, total, d]`` result (new, or ``into``), summed where
    ``reduce`` (heads several sources hold, or adding into ``into``): one strided copy
    (or add) when ``src`` is one tensor and the ranks' heads follow one pattern apart."""
    s_me, b = src[0].shape[0], src[0].shape[1]
    res = into if into is not None else \
        (torch.zeros if reduce else torch.empty)((b, s_me, total, d), dtype=dtype, device=src[0].device)
    reg = _regular(rows, total)
    if isinstance(src, torch.Tensor) and reg is not None and reg[1] >= reg[2]:
        dst = _strided(res, tuple(src.shape), reg[0], reg[1])
        if reduce:
            dst.add_(src)
        else:
            dst.copy_(src)
        return res
    for u in range(len(rows)):
        a, c = rows[u]
        if c > a:
            if reduce:
                res[:, :, a:c] += src[u].permute(1, 0, 2, 3)
            else:
                res[:, :, a:c].copy_(src[u].permute(1, 0, 2, 3))
    return res


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


def _homogeneous(tensors) -> bool:
    t0 = tensors[0]
    return all(t.dim() == 4 and t.dtype == t0.dtype and t.shape[3] == t0.shape[3] and t.shape[:2] == t0.shape[:2]
               for t in tensors)


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
