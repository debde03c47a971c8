"""Communication: the Ulysses all-to-all (any heads, any lengths, GQA) and the ring
rotation strategies (p2p and all-gather).

Wire format: every all-to-all chunk is sent sequence-major (``[S, B, h, D]``) so the
received buffer *is* the gathered sequence, with no reassembly copy; one
``all_to_all_single`` per tensor with uneven split sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------------- heads
@dataclass(frozen=True)
class HeadPlan:
    """Which global heads each Ulysses rank computes.

    ``q[u]`` is the contiguous query-head range ``(start, stop)`` of rank ``u`` (split as
    evenly as possible; ranks beyond H get an empty range).  ``kv[u]`` lists the global
    KV heads rank ``u`` receives, in local order: the distinct groups its query heads use
    when they align with whole groups, else one KV head per query head (only as much
    repetition as the split needs).
    """

    num_heads: int
    num_kv_heads: int
    q: Tuple[Tuple[int, int], ...]
    kv: Tuple[Tuple[int, ...], ...]

    def local_heads(self, u: int) -> Tuple[int, int]:
        a, b = self.q[u]
        return b - a, len(self.kv[u])


def head_plan(num_heads: int, num_kv_heads: int, ulysses: int) -> HeadPlan:
    if num_heads % num_kv_heads:
        raise ValueError(f"heads={num_heads} must be a multiple of kv_heads={num_kv_heads}")
    g = num_heads // num_kv_heads
    base, extra = divmod(num_heads, ulysses)
    q, kv, start = [], [], 0
    for u in range(ulysses):
        n = base + (1 if u < extra else 0)
        a, b = start, start + n
        start = b
        q.append((a, b))
        groups = [h // g for h in range(a, b)]
        uniq = sorted(set(groups))
        # local GQA works when each distinct kv head serves the same number of local q heads
        if groups and all(groups.count(x) == len(groups) // len(uniq) for x in uniq) and len(groups) % len(uniq) == 0:
            kv.append(tuple(uniq))
        else:
            kv.append(tuple(groups))
    return HeadPlan(num_heads, num_kv_heads, tuple(q), tuple(kv))


# ---------------------------------------------------------------------------------- ulysses
@dataclass(frozen=True)
class UlyssesSpec:
    """One all-to-all: ``heads[u]`` = global head indices rank ``u`` computes;
    ``seq_lens[u]`` = tokens rank ``u`` holds before the exchange."""

    group: object
    rank: int
    heads: Tuple[Tuple[int, ...], ...]
    seq_lens: Tuple[int, ...]
    total_heads: int

    @property
    def size(self) -> int:
        return len(self.seq_lens)


def _select_heads(x: torch.Tensor, heads: Sequence[int]) -> torch.Tensor:
    if len(heads) == 0:
        return x.narrow(2, 0, 0)
    a = heads[0]
    if list(heads) == list(range(a, a + len(heads))):
        return x.narrow(2, a, len(heads))
    return x.index_select(2, torch.tensor(heads, dtype=torch.long, device=x.device))


def _all_to_all(send: List[torch.Tensor], recv_numels: List[int], group, like: torch.Tensor) -> torch.Tensor:
    inp = torch.cat([c.reshape(-1) for c in send]) if len(send) > 1 else send[0].reshape(-1)
    out = like.new_empty(sum(recv_numels))
    dist.all_to_all_single(out, inp.contiguous(), recv_numels, [c.numel() for c in send], group=group)
    return out


def seq_to_head(x: torch.Tensor, spec: UlyssesSpec) -> torch.Tensor:
    """[B, S_local, H, D] -> [B, S_gathered, h_me, D] (a sequence-major view)."""
    b, _, _, d = x.shape
    mine = spec.heads[spec.rank]
    if spec.size == 1:
        return _select_heads(x, mine)
    send = [_select_heads(x, spec.heads[u]).permute(1, 0, 2, 3) for u in range(spec.size)]
    recv = [n * b * len(mine) * d for n in spec.seq_lens]
    out = _all_to_all(send, recv, spec.group, x)
    return out.view(sum(spec.seq_lens), b, len(mine), d).permute(1, 0, 2, 3)


def head_to_seq(y: torch.Tensor, spec: UlyssesSpec) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: [B, S_gathered, h_me, D] -> [B, S_local, H, D].
    Heads that several ranks computed (repeated KV heads) are summed (gradient of a copy)."""
    b, _, _, d = y.shape
    s_local = spec.seq_lens[spec.rank]
    if spec.size == 1:
        parts = [y]
    else:
        offs = [sum(spec.seq_lens[:u]) for u in range(spec.size)]
        send = [y.narrow(1, offs[u], spec.seq_lens[u]).permute(1, 0, 2, 3) for u in range(spec.size)]
        recv = [s_local * b * len(spec.heads[u]) * d for u in range(spec.size)]
        flat = _all_to_all(send, recv, spec.group, y)
        parts, o = [], 0
        for u in range(spec.size):
            n = recv[u]
            parts.append(flat.narrow(0, o, n).view(s_local, b, len(spec.heads[u]), d).permute(1, 0, 2, 3))
            o += n
    order = [h for hs in spec.heads for h in hs]
    if order == list(range(spec.total_heads)):
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].contiguous()
    out = y.new_zeros(b, s_local, spec.total_heads, d)
    for hs, part in zip(spec.heads, parts):
        if len(hs):
            out.index_add_(2, torch.tensor(hs, dtype=torch.long, device=y.device), part)
    return out


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


def all_gather_ints(values: Sequence[int], group=None) -> List[List[int]]:
    """Every rank's list of integers (all the same length), in group-rank order."""
    t = torch.tensor(list(values), dtype=torch.long, device=_meta_device(group))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def all_gather_bytes(data: bytes, group=None) -> List[bytes]:
    """Every rank's bytes (any lengths), in group-rank order; no pickling and no numpy."""
    sizes = [r[0] for r in all_gather_ints([len(data)], group)]
    width = max(sizes)
    if width == 0:
        return [b""] * len(sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(_meta_device(group))
    parts = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(parts, buf, group=group)
    return [bytes(p[:n].cpu().tolist()) for p, n in zip(parts, sizes)]


# ---------------------------------------------------------------------------------- ring
class P2PRotator:
    """Pass blocks around the ring with ``batch_isend_irecv``: send to the next rank,
    receive from the previous one, so the next block is in flight while this one computes."""

    name = "p2p"

    def __init__(self, group, ring_ranks: Sequence[int], ring_rank: int):
        self.group = group
        self.size = len(ring_ranks)
        self.next = ring_ranks[(ring_rank + 1) % self.size]
        self.prev = ring_ranks[(ring_rank - 1) % self.size]

    def start(self, sends: Sequence[torch.Tensor], recv_shapes: Sequence[torch.Size]):
        """Post sends of ``sends`` and receives into fresh buffers (never aliasing a buffer
        that is still being computed on).  Returns (recv buffers, requests)."""
        recvs = [s.new_empty(shape) for s, shape in zip(sends, recv_shapes)]
        ops = []
        for s, r in zip(sends, recvs):
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group))
        reqs = dist.batch_isend_irecv(ops)
        return recvs, reqs

    @staticmethod
    def wait(reqs) -> None:
        for r in reqs:
            r.wait()


def all_gather_blocks(buf: torch.Tensor, lengths: Sequence[int], group, seq_dim: int, async_op: bool = False):
    """All-gather one packed block per ring rank (uneven lengths padded to the longest).
    Returns (padded list, work handle or None)."""
    width = max(lengths)
    pad = width - buf.shape[seq_dim]
    if pad:
        shape = list(buf.shape)
        shape[seq_dim] = pad
        buf = torch.cat([buf, buf.new_zeros(shape)], dim=seq_dim)
    buf = buf.contiguous()
    out = [torch.empty_like(buf) for _ in lengths]
    work = dist.all_gather(out, buf, group=group, async_op=async_op)
    return out, work


def reduce_blocks_to_owners(blocks: Sequence[torch.Tensor], lengths: Sequence[int], ring_rank: int,
                            group, seq_dim: int) -> torch.Tensor:
    """Each rank holds a partial gradient for every ring rank's block; send each to its owner
    (one all-to-all) and sum what arrives.  Returns this rank's summed block."""
    width = max(lengths)
    padded = []
    for blk in blocks:
        pad = width - blk.shape[seq_dim]
        if pad:
            shape = list(blk.shape)
            shape[seq_dim] = pad
            blk = torch.cat([blk, blk.new_zeros(shape)], dim=seq_dim)
        padded.append(blk.contiguous())
    n = padded[0].numel()
    inp = torch.cat([p.reshape(-1) for p in padded])
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, [n] * len(padded), [n] * len(padded), group=group)
    total = out.view(len(padded), *padded[0].shape).sum(0)
    return total.narrow(seq_dim, 0, lengths[ring_rank])
