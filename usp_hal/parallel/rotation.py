"""Ring rotation strategies: how each ring rank meets every key/value block, and how the
partial dK/dV of each block gets back to its owner.

The ring forward and backward (``usp_hal.parallel.ring``) each have one loop over
``rotation.blocks(k, v)``; the strategy decides what travels when:

``p2p``        blocks move one hop per step with ``batch_isend_irecv`` (send to the next
               ring rank, receive from the previous one), the next block in flight while the
               current one computes.  Backward: block ``b``'s dK/dV is summed along the chain
               ``b+1 -> ... -> b`` (each rank adds its part to what arrived and passes it on;
               ``R-1`` hops, each overlapping the next block's compute).
``allgather``  every block is gathered up front (one ``all_gather``, in flight while the own
               block computes); memory holds all ``R`` blocks.  Backward: the partials go to
               their owners in one ``all_to_all``.

K and V (and dK and dV) travel side by side in one batch of p2p ops; a wire codec
(``usp_hal.parallel.codec``) codes the K/V blocks into one byte buffer; the own block is coded too, so
every key sees the same rounding.  A rank's part of a block's dK/dV is a :class:`GradPart`
(:class:`Accum` each): nothing is allocated until a kernel call adds to it, and a kernel
gradient over the whole block is the part itself, so a rotation mostly sends (or adds into
what arrived) the kernel's own gradients.  A new rotation is one class added to :data:`ROTATIONS`.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist

from . import wire
from .codec import Codec
from .comm import _all_gather_single, collective, wait


class KVBlock:
    """K and V of one ring block in one flat buffer (``k``/``v`` are views of ``buf``)."""

    def __init__(self, buf: torch.Tensor, k_shape, v_shape, dtype, codecs=None):
        self.buf, self.k_shape, self.v_shape, self.dtype = buf, tuple(k_shape), tuple(v_shape), dtype
        self.codecs = codecs
        self._kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def kv(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            if self.codecs is None:
                nk = _numel(self.k_shape)
                self._kv = (self.buf.narrow(0, 0, nk).view(self.k_shape),
                            self.buf.narrow(0, nk, _numel(self.v_shape)).view(self.v_shape))
            else:
                self._kv = _decode_bytes(self.buf, self.k_shape, self.v_shape, self.dtype, self.codecs)
        return self._kv


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _with_len(shape, n: int, seq_dim: int = 1):
    s = list(shape)
    s[seq_dim] = n
    return tuple(s)


# ------------------------------------------------------------------ gradient accumulators
Where = Union[Tuple[int, int], torch.Tensor]
"""Where a kernel's gradient piece falls along dim 1: a ``(start, stop)`` range, or an index tensor."""


class Accum:
    """One float accumulator ``[B, N, ...]`` (the merge dtype) summed from the kernel's
    gradient pieces, allocated only when it must be.

    The first piece that covers every position *becomes* the accumulator (converted to the
    dtype only when it is not in it already: no zero buffer, no add); a piece over part of
    the positions is kept as it is while it is the only one, so that :meth:`into` can add it
    straight into another buffer (the partial dK/dV that arrived from the previous ring rank)
    instead of into zeros; a second piece starts zeros and adds both.  Every sum is the one
    a zeroed buffer would hold (``0 + x`` is ``x``)."""

    __slots__ = ("shape", "dtype", "device", "full", "piece")

    def __init__(self, shape, dtype: torch.dtype, device) -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.full: Optional[torch.Tensor] = None
        self.piece: Optional[Tuple[torch.Tensor, Where]] = None

    def add(self, g: torch.Tensor, where: Where) -> None:
        """Add the piece ``g`` ``[B, n, ...]`` at ``where`` (dim 1)."""
        if self.full is None:
            if self.piece is None:
                if isinstance(where, tuple) and where == (0, self.shape[1]) and tuple(g.shape) == self.shape:
                    self.full = _owned(g, self.dtype)
                else:
                    self.piece = (g, where)
                return
            self.full = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            _add_at(self.full, *self.piece)
            self.piece = None
        _add_at(self.full, g, where)

    def into(self, acc: torch.Tensor) -> torch.Tensor:
        """``acc`` (full shape, this dtype) += what this holds, in place; returns ``acc``.
        This accumulator is empty afterwards."""
        if self.full is not None:
            acc += self.full
        elif self.piece is not None:
            _add_at(acc, *self.piece)
        self.full = self.piece = None
        return acc

    def take(self) -> torch.Tensor:
        """The summed tensor (zeros where no piece fell); this accumulator is empty afterwards."""
        got = self.full
        if got is None:
            got = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            if self.piece is not None:
                _add_at(got, *self.piece)
        self.full = self.piece = None
        return got


def _owned(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g`` as an accumulator of ``dtype`` that may be written in place: itself when it is in
    the dtype, contiguous and alone in its storage, else a converted (or compact) copy."""
    if g.dtype != dtype:
        g = g.to(dtype)
    if not g.is_contiguous():
        return g.contiguous()
    if g.untyped_storage().nbytes() != g.numel() * g.element_size():   # a view into a larger buffer
        return g.clone()
    return g


def _add_at(acc: torch.Tensor, g: torch.Tensor, where: Where) -> None:
    if isinstance(where, tuple):
        acc[:, where[0]:where[1]] += g
    else:
        acc.index_add_(1, where, g.to(acc.dtype))


class GradPart:
    """This rank's part of one ring block's dK/dV: an :class:`Accum` for each."""

    __slots__ = ("k", "v")

    def __init__(self, k_shape, v_shape, dtype: torch.dtype, device) -> None:
        self.k, self.v = Accum(k_shape, dtype, device), Accum(v_shape, dtype, device)

    def add(self, gk: torch.Tensor, gv: torch.Tensor, where: Where) -> None:
        self.k.add(gk, where)
        self.v.add(gv, where)

    def into(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` += this part, in place (what arrived from the previous rank, say)."""
        return self.k.into(k), self.v.into(v)

    def take(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.k.take(), self.v.take()


# byte layout of a coded block: each codec part of k, then of v, 16-byte aligned
def _coded_parts(shape, dtype, codec: Codec):
    probe = codec.encode(torch.empty((1,) * (len(shape) - 1) + (shape[-1],), dtype=dtype))
    return [(tuple(shape[:-1]) + (p.shape[-1],), p.dtype) for p in probe]


def _coded_specs(k_shape, v_shape, dtype, codecs):
    return _coded_parts(k_shape, dtype, codecs[0]) + _coded_parts(v_shape, dtype, codecs[1])


def _coded_size(k_shape, v_shape, dtype, codecs) -> int:
    return wire.packed_size(_coded_specs(k_shape, v_shape, dtype, codecs))


def _encode_bytes(k, v, codecs) -> torch.Tensor:
    return wire.pack(codecs[0].encode(k) + codecs[1].encode(v), device=k.device)


def _decode_bytes(buf, k_shape, v_shape, dtype, codecs):
    kspecs = _coded_parts(k_shape, dtype, codecs[0])
    parts = wire.views(buf, kspecs + _coded_parts(v_shape, dtype, codecs[1]))
    return codecs[0].decode(parts[:len(kspecs)], dtype), codecs[1].decode(parts[len(kspecs):], dtype)


class Rotation:
    """Base: one ring rank (``ring_size == 1``) just sees its own block."""

    name = "none"

    def __init__(self, group, ring_ranks: Sequence[int], ring_rank: int, lengths: Sequence[int], *,
                 where: str = "ring group", codecs: Optional[Tuple[Codec, Codec]] = None):
        self.group, self.ring_ranks, self.me = group, tuple(ring_ranks), ring_rank
        self.size = len(ring_ranks)
        self.lengths = tuple(int(n) for n in lengths)
        self.where = where
        # nothing travels on a ring of one: no codec applies there
        self.codecs = codecs if codecs and self.size > 1 and not all(c.identity for c in codecs) else None
        self.next = self.ring_ranks[(ring_rank + 1) % self.size]
        self.prev = self.ring_ranks[(ring_rank - 1) % self.size]
        self._own: Optional[GradPart] = None

    # ------------------------------------------------------------------ blocks
    def own_block(self, k, v) -> KVBlock:
        """This rank's K/V packed (and coded) as it travels."""
        if self.codecs is not None:
            return KVBlock(_encode_bytes(k, v, self.codecs), k.shape, v.shape, k.dtype, self.codecs)
        buf = torch.empty(k.numel() + v.numel(), dtype=k.dtype, device=k.device)
        buf.narrow(0, 0, k.numel()).view(k.shape).copy_(k)
        buf.narrow(0, k.numel(), v.numel()).view(v.shape).copy_(v)
        return KVBlock(buf, k.shape, v.shape, k.dtype)

    def local_kv(self, k, v):
        """The own block as the kernel sees it (coded and decoded when a codec is on)."""
        if self.codecs is None:
            return k, v
        return _decode_bytes(_encode_bytes(k, v, self.codecs), k.shape, v.shape, k.dtype, self.codecs)

    def blocks(self, k, v) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(source ring rank, k block, v block)`` for every block, own block first."""
        kk, vv = self.local_kv(k, v)
        yield self.me, kk, vv

    def block_done(self) -> None:
        """The current block's kernels have run (its K/V is no longer needed here)."""

    # ------------------------------------------------------------------ gradients
    def new_grad(self, src: int, k, v, dtype) -> GradPart:
        """This rank's (still empty) part of the dK/dV of block ``src``, in ``dtype``."""
        n = self.lengths[src]
        return GradPart(_with_len(k.shape, n), _with_len(v.shape, n), dtype, k.device)

    def add_grad(self, step: int, src: int, grad: GradPart) -> None:
        """Hand over this rank's part of block ``src``'s dK/dV (after computing it)."""
        self._own = grad

    def own_grad(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """After the loop: this rank's block's (dK, dV) summed over every ring rank."""
        assert self._own is not None, "own_grad() before add_grad()"
        own, self._own = self._own, None
        return own.take()


class P2PRotation(Rotation):
    name = "p2p"

    def _start(self, send: torch.Tensor, recv: torch.Tensor, what: str):
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return collective(what, self.where, dist.batch_isend_irecv, ops)

    def _recv_like(self, blk: KVBlock, n: int) -> KVBlock:
        """A receive buffer for ``blk``'s K/V at ``n`` tokens."""
        ks, vs = _with_len(blk.k_shape, n), _with_len(blk.v_shape, n)
        if blk.codecs is not None:
            size = _coded_size(ks, vs, blk.dtype, blk.codecs)
        else:
            size = _numel(ks) + _numel(vs)
        return KVBlock(blk.buf.new_empty(size), ks, vs, blk.dtype, blk.codecs)

    def _start_kv(self, send: Tuple[torch.Tensor, torch.Tensor], recv: Tuple[torch.Tensor, torch.Tensor], what: str):
        ops = [dist.P2POp(dist.isend, send[0], self.next, self.group),
               dist.P2POp(dist.isend, send[1], self.next, self.group),
               dist.P2POp(dist.irecv, recv[0], self.prev, self.group),
               dist.P2POp(dist.irecv, recv[1], self.prev, self.group)]
        return collective(what, self.where, dist.batch_isend_irecv, ops)

    #: the block in use, the next block in flight (block, works), whether the current block
    #: still counts as in use, the partial dK/dV in flight to this rank (tensors, works)
    _cur: Any = None
    _hop: Any = None
    _live = False
    _incoming: Any = None

    def blocks(self, k, v):
        """The block in use is held on the rotation (``_cur``), not in the generator, so that
        :meth:`block_done` can let it go as soon as its kernels ran (before the backward's
        dK/dV hop allocates); the next block travels while the current one computes."""
        self._cur, self._hop, self._live = None, None, False
        if self.size == 1:
            yield from super().blocks(k, v)
            return
        R, me = self.size, self.me
        label = "ring p2p rotation of K/V"
        plain = self.codecs is None
        # uncoded K and V travel as they are, side by side in one batch of p2p ops: no packing
        # copy (none at all for contiguous inputs) and no buffer holding both
        if plain:
            self._cur = (k if k.is_contiguous() else k.contiguous(), v if v.is_contiguous() else v.contiguous())
        else:
            self._cur = self.own_block(k, v)
        for step in range(R):
            src = (me - step) % R
            if step < R - 1:   # the next block travels while this one computes
                n, cur = self.lengths[(src - 1) % R], self._cur
                if plain:
                    nxt = (cur[0].new_empty(_with_len(cur[0].shape, n)),
                           cur[1].new_empty(_with_len(cur[1].shape, n)))
                    self._hop = (nxt, self._start_kv(cur, nxt, label))
                else:
                    nxt = self._recv_like(cur, n)
                    self._hop = (nxt, self._start(cur.buf, nxt.buf, label))
                del nxt, cur
            self._live = True
            if step == 0 and self.codecs is None:
                yield src, k, v          # the own block as it is (a packed copy only travels)
            elif plain:
                yield (src,) + self._cur
            else:
                yield (src,) + self._cur.kv
            self.block_done()          # a no-op when the backward's add_grad called it already
        self._cur = None

    def block_done(self) -> None:
        """Let the current block go (it may still be on its way to the next rank: the hop in
        flight is waited for here, and the next block becomes the current one)."""
        if not self._live:
            return
        self._live, self._cur = False, None
        if self._hop is not None:
            nxt, reqs = self._hop
            self._hop = None
            wait("ring p2p rotation of K/V", self.where, reqs)
            del reqs
            self._cur = nxt

    def _arrived(self, label: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """The partial dK/dV from the previous rank, once it (and this rank's last send) completed."""
        inc, reqs = self._incoming
        self._incoming = None
        wait(label, self.where, reqs)
        return inc

    def add_grad(self, step, src, grad):
        self.block_done()
        if self.size == 1 or step == 0:
            self._own = grad
            self._incoming = None
            return
        label = "ring p2p hop of dK/dV (backward)"
        if self._incoming is not None:   # earlier ranks' part of this block, arrived meanwhile
            send = grad.into(*self._arrived(label))
        else:
            send = grad.take()
        del grad
        send = tuple(t if t.is_contiguous() else t.contiguous() for t in send)
        n = self.lengths[(src - 1) % self.size]
        recv = (send[0].new_empty(_with_len(send[0].shape, n)), send[1].new_empty(_with_len(send[1].shape, n)))
        self._incoming = (recv, self._start_kv(send, recv, label))

    def own_grad(self):
        own, self._own = self._own, None
        assert own is not None, "own_grad() before add_grad()"
        if self.size > 1 and self._incoming is not None:   # every other rank's part of our block
            return own.into(*self._arrived("ring p2p hop of dK/dV (backward)"))
        return own.take()


class AllGatherRotation(Rotation):
    name = "allgather"
    _grads: Dict[int, GradPart]

    def blocks(self, k, v):
        if self.size == 1:
            yield from super().blocks(k, v)
            return
        R, me = self.size, self.me
        own = self.own_block(k, v)
        width = max(self.lengths)
        padded = self._recv_shape(own, width)
        send = own.buf if own.buf.numel() == padded else self._pad(own, width)
        gathered = send.new_empty(R * padded)
        label = "ring all-gather of K/V"
        work = collective(label, self.where, _all_gather_single, gathered, send, group=self.group, async_op=True)
        yield (me,) + tuple(self.local_kv(k, v))     # own block while the gather is in flight
        wait(label, self.where, work)
        for step in range(1, R):
            src = (me - step) % R
            full = KVBlock(gathered.narrow(0, src * padded, padded), _with_len(own.k_shape, width),
                           _with_len(own.v_shape, width), own.dtype, own.codecs)
            kk, vv = full.kv
            n = self.lengths[src]
            yield src, kk.narrow(1, 0, n), vv.narrow(1, 0, n)

    def _recv_shape(self, blk: KVBlock, n: int) -> int:
        ks, vs = _with_len(blk.k_shape, n), _with_len(blk.v_shape, n)
        if blk.codecs is not None:
            return _coded_size(ks, vs, blk.dtype, blk.codecs)
        return _numel(ks) + _numel(vs)

    def _pad(self, blk: KVBlock, width: int) -> torch.Tensor:
        ks, vs = _with_len(blk.k_shape, width), _with_len(blk.v_shape, width)
        if blk.codecs is not None:   # code the zero-padded K/V again
            kk, vv = _decode_bytes(blk.buf, blk.k_shape, blk.v_shape, blk.dtype, blk.codecs)
            kz = kk.new_zeros(ks)
            vz = vv.new_zeros(vs)
            kz[:, :kk.shape[1]] = kk
            vz[:, :vv.shape[1]] = vv
            return _encode_bytes(kz, vz, blk.codecs)
        k, v = blk.kv
        buf = blk.buf.new_zeros(_numel(ks) + _numel(vs))
        buf.narrow(0, 0, _numel(ks)).view(ks)[:, :k.shape[1]] = k
        buf.narrow(0, _numel(ks), _numel(vs)).view(vs)[:, :v.shape[1]] = v
        return buf

    def add_grad(self, step, src, grad):
        if step == 0:
            self._grads = {}
        self._grads[src] = grad

    def own_grad(self):
        grads, self._grads = self._grads, {}
        if self.size == 1:
            return grads[self.me].take()
        R, me = self.size, self.me
        width = max(self.lengths)
        own = grads[me]
        ks, vs = _with_len(own.k.shape, width), _with_len(own.v.shape, width)
        n = _numel(ks) + _numel(vs)
        send = torch.zeros(R * n, dtype=own.k.dtype, device=own.k.device)
        for src, g in grads.items():     # each part goes straight into its (zeroed, padded) slot
            blk = send.narrow(0, src * n, n)
            g.into(blk.narrow(0, 0, _numel(ks)).view(ks)[:, :g.k.shape[1]],
                   blk.narrow(0, _numel(ks), _numel(vs)).view(vs)[:, :g.v.shape[1]])
        del grads, g
        recv = torch.empty_like(send)
        collective("ring all-to-all of dK/dV to their owners (backward)", self.where, dist.all_to_all_single,
                   recv, send, [n] * R, [n] * R, group=self.group)
        del send
        total = recv.view(R, n).sum(0)
        del recv
        ln = self.lengths[me]
        dk = total.narrow(0, 0, _numel(ks)).view(ks)
        dv = total.narrow(0, _numel(ks), _numel(vs)).view(vs)
        if ln == width:
            return dk, dv
        return dk[:, :ln].contiguous(), dv[:, :ln].contiguous()


ROTATIONS: Dict[str, Type[Rotation]] = {"p2p": P2PRotation, "allgather": AllGatherRotation}
"""Rotation strategies by name (``LongContextAttention(rotation=...)``, the CLI's choices)."""


def get_rotation(name: str) -> Type[Rotation]:
    try:
        return ROTATIONS[str(name)]
    except KeyError:
        raise ValueError(f"rotation={name!r}; valid: {', '.join(ROTATIONS)}") from None


def rotation_names() -> List[str]:
    return list(ROTATIONS)
