"""Ring rotation strategies: how each ring rank meets every key/value block, and how the
partial dK/dV of each block gets back to its owner.

The ring forward and backward (``usp_hal.ring``) each have one loop over
``rotation.blocks(k, v)``; the strategy decides what travels when:

``p2p``        blocks move one hop per step with ``batch_isend_irecv`` (send to the next
               ring rank, receive from the previous one), the next block in flight while the
               current one computes.  Backward: block ``b``'s dK/dV is summed along the chain
               ``b+1 -> ... -> b`` (each rank adds its part to what arrived and passes it on;
               ``R-1`` hops, each overlapping the next block's compute).
``allgather``  every block is gathered up front (one ``all_gather``, in flight while the own
               block computes); memory holds all ``R`` blocks.  Backward: the partials go to
               their owners in one ``all_to_all``.

K and V travel together in one buffer (one message per hop).  A wire codec (``usp_hal.codec``)
can code the blocks; the own block is coded too, so every key sees the same rounding.
A new rotation is one class added to :data:`ROTATIONS`.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Type

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
        self._own: Optional[KVBlock] = None

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

    # ------------------------------------------------------------------ gradients
    def new_grad(self, src: int, k, v, dtype) -> KVBlock:
        """Zeroed float accumulators for the dK/dV of block ``src`` (one flat buffer)."""
        n = self.lengths[src]
        ks, vs = _with_len(k.shape, n), _with_len(v.shape, n)
        buf = torch.zeros(_numel(ks) + _numel(vs), dtype=dtype, device=k.device)
        return KVBlock(buf, ks, vs, dtype)

    def add_grad(self, step: int, src: int, grad: KVBlock) -> None:
        """Hand over this rank's part of block ``src``'s dK/dV (after computing it)."""
        self._own = grad

    def own_grad(self) -> KVBlock:
        """After the loop: this rank's block's dK/dV summed over every ring rank."""
        assert self._own is not None, "own_grad() before add_grad()"
        return self._own


class P2PRotation(Rotation):
    name = "p2p"

    def _start(self, send: torch.Tensor, recv: torch.Tensor, what: str):
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return collective(what, self.where, dist.batch_isend_irecv, ops)

    def _recv_like(self, blk: KVBlock, n: int) -> KVBlock:
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

    def blocks(self, k, v):
        if self.size == 1:
            yield from super().blocks(k, v)
            return
        if self.codecs is None:
            yield from self._plain_blocks(k, v)
            return
        R, me = self.size, self.me
        blk = self.own_block(k, v)
        label = "ring p2p rotation of K/V"
        for step in range(R):
            src = (me - step) % R
            if step < R - 1:   # the next block travels while this one computes
                nxt = self._recv_like(blk, self.lengths[(src - 1) % R])
                reqs = self._start(blk.buf, nxt.buf, label)
            kk, vv = (k, v) if (step == 0 and self.codecs is None) else blk.kv
            yield src, kk, vv
            if step < R - 1:
                wait(label, self.where, reqs)
                blk = nxt

    def _plain_blocks(self, k, v):
        """Uncoded K and V travel as they are, side by side in one batch of p2p ops: no packing
        copy (none at all for contiguous inputs) and no buffer holding both."""
        R, me = self.size, self.me
        label = "ring p2p rotation of K/V"
        cur = (k if k.is_contiguous() else k.contiguous(), v if v.is_contiguous() else v.contiguous())
        for step in range(R):
            src = (me - step) % R
            if step < R - 1:   # the next block travels while this one computes
                n = self.lengths[(src - 1) % R]
                nxt = (cur[0].new_empty(_with_len(cur[0].shape, n)), cur[1].new_empty(_with_len(cur[1].shape, n)))
                reqs = self._start_kv(cur, nxt, label)
            yield (src, k, v) if step == 0 else (src, cur[0], cur[1])
            if step < R - 1:
                wait(label, self.where, reqs)
                cur = nxt
        del cur

    def add_grad(self, step, src, grad):
        if self.size == 1 or step == 0:
            self._own = grad
            self._incoming = None
            return
        label = "ring p2p hop of dK/dV (backward)"
        if self._incoming is not None:   # earlier ranks' part of this block, arrived meanwhile
            inc, reqs = self._incoming
            wait(label, self.where, reqs)
            grad.buf += inc.buf
        n_next = self.lengths[(src - 1) % self.size]
        nxt = KVBlock(grad.buf.new_empty(_numel(_with_len(grad.k_shape, n_next)) +
                                         _numel(_with_len(grad.v_shape, n_next))),
                      _with_len(grad.k_shape, n_next), _with_len(grad.v_shape, n_next), grad.dtype)
        self._incoming = (nxt, self._start(grad.buf, nxt.buf, label))

    def own_grad(self):
        if self.size > 1 and self._incoming is not None:   # every other rank's part of our block
            inc, reqs = self._incoming
            wait("ring p2p hop of dK/dV (backward)", self.where, reqs)
            self._own.buf += inc.buf
            self._incoming = None
        return self._own


class AllGatherRotation(Rotation):
    name = "allgather"

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
        if self.size == 1:
            return self._grads[self.me]
        R, me = self.size, self.me
        width = max(self.lengths)
        own = self._grads[me]
        ks, vs = _with_len(own.k_shape, width), _with_len(own.v_shape, width)
        n = _numel(ks) + _numel(vs)
        send = own.buf.new_zeros(R * n)
        for src, g in self._grads.items():
            blk = send.narrow(0, src * n, n)
            gk = g.buf.narrow(0, 0, _numel(g.k_shape)).view(g.k_shape)
            blk.narrow(0, 0, _numel(ks)).view(ks)[:, :g.k_shape[1]] = gk
            blk.narrow(0, _numel(ks), _numel(vs)).view(vs)[:, :g.v_shape[1]] = \
                g.buf.narrow(0, _numel(g.k_shape), _numel(g.v_shape)).view(g.v_shape)
        recv = torch.empty_like(send)
        collective("ring all-to-all of dK/dV to their owners (backward)", self.where, dist.all_to_all_single,
                   recv, send, [n] * R, [n] * R, group=self.group)
        total = recv.view(R, n).sum(0)
        ln = self.lengths[me]
        dk = total.narrow(0, 0, _numel(ks)).view(ks)[:, :ln]
        dv = total.narrow(0, _numel(ks), _numel(vs)).view(vs)[:, :ln]
        buf = torch.empty(_numel(own.k_shape) + _numel(own.v_shape), dtype=own.dtype, device=own.buf.device)
        out = KVBlock(buf, own.k_shape, own.v_shape, own.dtype)
        ok, ov = out.kv
        ok.copy_(dk)
        ov.copy_(dv)
        return out


ROTATIONS: Dict[str, Type[Rotation]] = {"p2p": P2PRotation, "allgather": AllGatherRotation}
"""Rotation strategies by name (``LongContextAttention(rotation=...)``, the CLI's choices)."""


def get_rotation(name: str) -> Type[Rotation]:
    try:
        return ROTATIONS[str(name)]
    except KeyError:
        raise ValueError(f"rotation={name!r}; valid: {', '.join(ROTATIONS)}") from None


def rotation_names() -> List[str]:
    return list(ROTATIONS)
