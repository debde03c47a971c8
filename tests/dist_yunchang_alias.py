"""Rank functions for tests/test_yunchang_alias.py: the yunchang submodule functions the alias
serves (usp_hal.compat.alias), on real gloo groups, against one process."""
import torch
import torch.distributed as dist

from usp_hal.compat import alias
from usp_hal.dispatch.reference import reference_attention


def _full(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def all_to_all(P: int = 2):
    """all_to_all_4D both ways, SeqAllToAll4D forward and backward, all_to_all_5D: each rank's
    result against the slice of the full tensor it must hold; the max error of each."""
    rank = dist.get_rank()
    B, S, H, D = 2, 6, 4, 3
    x = _full((B, S, H, D), 0)
    s, h = S // P, H // P
    mine = x[:, rank * s:(rank + 1) * s]                    # my sequence chunk, every head
    want_heads = x[:, :, rank * h:(rank + 1) * h]           # every position, my heads
    errs = {}
    got = alias.all_to_all_4D(mine.contiguous(), scatter_idx=2, gather_idx=1)
    errs["seq_to_heads"] = (got - want_heads).abs().max().item()
    back = alias.all_to_all_4D(want_heads.contiguous(), scatter_idx=1, gather_idx=2)
    errs["heads_to_seq"] = (back - mine).abs().max().item()
    # SeqAllToAll4D: forward as above; the gradient of sum(y * w) is w sent back
    w = _full((B, S, H, D), 1)
    xin = mine.clone().requires_grad_()
    y = alias.SeqAllToAll4D.apply(None, xin, 2, 1)
    (y * w[:, :, rank * h:(rank + 1) * h]).sum().backward()
    errs["apply_fwd"] = (y - want_heads).abs().max().item()
    errs["apply_bwd"] = (xin.grad - w[:, rank * s:(rank + 1) * s]).abs().max().item()
    qkv = _full((B, S, 3, H, D), 2)
    got5 = alias.all_to_all_5D(qkv[:, rank * s:(rank + 1) * s].contiguous(), 3, 1)
    errs["5d"] = (got5 - qkv[:, :, :, rank * h:(rank + 1) * h]).abs().max().item()
    return errs


def ring_forward_backward(causal: bool, P: int = 2):
    """ring_flash_attn_forward, ring_flash_attn_backward and RingFlashAttnFunc on the basic
    layout over the world group against float64 attention in one process; RingComm's
    send/recv; the output without the ring (local attention) for the bypass check."""
    rank = dist.get_rank()
    B, S, H, D = 1, 8, 2, 4
    q, k, v, dout = (_full((B, S, H, D), i + 10) for i in range(4))
    s = S // P
    ql, kl, vl, dl = (t[:, rank * s:(rank + 1) * s].contiguous() for t in (q, k, v, dout))
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(qd, kd, vd, causal=causal)
    ref.backward(dout)
    mine = slice(rank * s, (rank + 1) * s)
    errs = {}
    out, lse = alias.ring_flash_attn_forward(None, ql, kl, vl, softmax_scale=D ** -0.5, causal=causal,
                                             attn_type="sdpa")
    errs["out"] = (out - ref[:, mine]).abs().max().item()
    errs["lse"] = (lse - ref_lse[:, :, mine]).abs().max().item()
    errs["lse_shape"] = tuple(lse.shape) == (B, H, s)
    dq, dk, dv = alias.ring_flash_attn_backward(None, dl, ql, kl, vl, out, lse, softmax_scale=D ** -0.5,
                                                causal=causal, attn_type="sdpa")
    for name, g, full in (("dq", dq, qd), ("dk", dk, kd), ("dv", dv, vd)):
        errs[name] = (g - full.grad[:, mine]).abs().max().item()
    qa, ka, va = (t.clone().requires_grad_() for t in (ql, kl, vl))
    o2, lse2, none = alias.RingFlashAttnFunc.apply(qa, ka, va, 0.0, None, causal, (-1, -1), 0.0, None, False, True,
                                                   None, "sdpa", None)
    o2.backward(dl)
    errs["apply_out"] = (o2 - ref[:, mine]).abs().max().item()
    errs["apply_dq"] = (qa.grad - qd.grad[:, mine]).abs().max().item()
    errs["apply_dk"] = (ka.grad - kd.grad[:, mine]).abs().max().item()
    errs["apply_none"] = none is None
    local, _ = reference_attention(ql, kl, vl, causal=causal)
    errs["bypassed"] = (local - ref[:, mine]).abs().max().item()
    comm = alias.RingComm(None)
    got = comm.send_recv(torch.full((3,), float(rank)))
    comm.commit()
    comm.wait()
    errs["ringcomm"] = got.tolist() == [float((rank - 1) % P)] * 3
    return errs


def globals_groups():
    """set_seq_parallel_pg of yunchang.globals fills PROCESS_GROUP with the mesh's groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    alias.set_seq_parallel_pg(2, 1, rank, world)
    pg = alias.PROCESS_GROUP
    return (pg is alias.ProcessGroupSingleton(), dist.get_world_size(pg.ULYSSES_PG), dist.get_world_size(pg.RING_PG))
