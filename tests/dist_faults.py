"""Rank-side functions for the fault and odd-input tests (tests/test_reliability.py)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import _err, get_mesh
from usp_hal.reference import reference_attention


def unshard_mismatch(U=2, R=1, what="heads"):
    """One rank's part has a different shape or dtype: every rank raises, the group survives."""
    mesh = get_mesh(U, R)
    x = torch.randn(1, 8, 2, 4, generator=torch.Generator().manual_seed(0))
    local = usp_hal.shard(x, mesh=mesh)
    if dist.get_rank() == 1:
        if what == "heads":
            local = torch.randn(1, local.shape[1], 3, 4)
        elif what == "dtype":
            local = local.double()
        elif what == "ndim":
            local = local[0]
        elif what == "length":
            local = local[:, :-2]   # 4 + 2 tokens: basic for S=6 is 3 + 3
    t0 = time.monotonic()
    try:
        usp_hal.unshard(local, mesh=mesh)
        err = None
    except ValueError as exc:
        err = str(exc)
    elapsed = time.monotonic() - t0
    # the group still works: a correct unshard afterwards
    back = usp_hal.unshard(usp_hal.shard(x, mesh=mesh), mesh=mesh)
    return {"error": err, "elapsed": elapsed, "after_ok": bool(torch.equal(back, x))}


def unshard_gradient(U=1, R=2, layout="zigzag", reduce_grad=False):
    """A loss on the gathered output trains the local parts: gradients equal single-process ones."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(5)
    S, H, D = 13, 3, 8
    q, k, v = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(1, S, H, D, generator=g, dtype=torch.float64)
    # single process
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal=True)
    loss_ref = (ref * w).sum() if not reduce_grad else (ref * w)[:, :7].sum() + (ref * w)[:, 7:].sum()
    loss_ref.backward()
    # distributed: shard, attention, unshard, the same loss on every rank
    ql, kl, vl = (usp_hal.shard(x, layout=layout, mesh=mesh).requires_grad_() for x in (q, k, v))
    out = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)(ql, kl, vl, causal=True)
    full = usp_hal.unshard(out, layout=layout, mesh=mesh, reduce_grad=reduce_grad)
    if reduce_grad:   # each rank takes a different part of the loss; the sum over ranks is the loss
        r = mesh.sp_rank
        loss = (full * w)[:, :7].sum() if r == 0 else (full * w)[:, 7:].sum() if r == 1 else full.sum() * 0
    else:
        loss = (full * w).sum()
    loss.backward()
    sh = lambda t: usp_hal.shard(t, layout=layout, mesh=mesh)  # noqa: E731
    return {"out": _err(full, ref, torch.float64),
            **{n: _err(t.grad, sh(r.grad), torch.float64) for n, t, r in (("dq", ql, qr), ("dk", kl, kr),
                                                                            ("dv", vl, vr))}}


def local_positions_match(U=2, R=2, layout="zigzag", S=11):
    mesh = get_mesh(U, R)
    x = torch.arange(S).view(1, S)
    return bool(torch.equal(usp_hal.shard(x, layout=layout, mesh=mesh)[0], mesh.local_positions(S, layout)))
