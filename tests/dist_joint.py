"""Rank-side functions for joint (MMDiT) attention tests (tests/test_joint.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import _err, get_mesh
from usp_hal.dispatch.reference import reference_attention


def joint_case(U=2, R=1, strategy="front", causal=False, layout="zigzag", S=14, J=7, H=4, Hkv=2, D=8,
               dtype="fp64", grad=True, return_lse=False, mask=None, sinks=False):
    """Joint tokens (J, split over the ranks in rank order) + main tokens (S, sharded in the
    layout) equal single-device attention on the concatenated sequence; the joint K/V
    gradients summed over the ranks equal the reference's.  ``mask``: a name of
    tests.dist_masks.family, over the concatenated sequence (joint and main tokens);
    ``sinks``: per-head sink logits too (their gradient summed over the ranks)."""
    mesh = get_mesh(U, R)
    dt = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(21)

    def rnd(n, h):
        return torch.randn(1, n, h, D, generator=g).to(dt)
    q, k, v, jq, jk, jv = rnd(S, H), rnd(S, Hkv), rnd(S, Hkv), rnd(J, H), rnd(J, Hkv), rnd(J, Hkv)
    dout_main, dout_joint = rnd(S, H), rnd(J, H)
    # reference on the concatenated sequence
    cat = (lambda a, b: torch.cat([b, a], 1)) if strategy == "front" else (lambda a, b: torch.cat([a, b], 1))
    leaves = [x.double().clone().requires_grad_(grad) for x in (q, k, v, jq, jk, jv)]
    m = keep = None
    if mask is not None:
        from tests.dist_masks import family
        m = family(mask, S + J, 1, H)
        keep = m.keep(torch.arange(S + J), torch.arange(S + J))
    sink = torch.randn(H, generator=g).to(dt) * 2 if sinks else None
    sink_ref = sink.double().clone().requires_grad_(grad) if sink is not None else None
    ro, rl = reference_attention(cat(leaves[0], leaves[3]), cat(leaves[1], leaves[4]), cat(leaves[2], leaves[5]),
                                 causal=causal, mask=keep, sinks=sink_ref)
    if grad:
        ro.backward(cat(dout_main, dout_joint).double())
    # distributed
    n = mesh.sp_size
    share = torch.tensor_split(torch.arange(J), n)[mesh.sp_rank]
    sh = lambda x: usp_hal.shard(x, layout=layout, mesh=mesh)  # noqa: E731
    loc = [sh(x).requires_grad_(grad) for x in (q, k, v)]
    jql = jq.index_select(1, share).requires_grad_(grad)
    jkl, jvl = jk.clone().requires_grad_(grad), jv.clone().requires_grad_(grad)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh)
    sink_loc = sink.clone().requires_grad_(grad) if sink is not None else None
    res = attn(*loc, causal=causal, joint_tensor_query=jql, joint_tensor_key=jkl, joint_tensor_value=jvl,
               joint_strategy=strategy, return_lse=return_lse, mask=m, sinks=sink_loc)
    out, lse = res if return_lse else (res, None)
    jn = share.numel()
    if strategy == "front":
        out_j, out_m = out[:, :jn], out[:, jn:]
    else:
        out_m, out_j = out[:, :-jn] if jn else out, out[:, out.shape[1] - jn:]
    # reference rows in the same arrangement
    ro_m = ro[:, J:] if strategy == "front" else ro[:, :S]
    ro_j = ro[:, :J] if strategy == "front" else ro[:, S:]
    errs = {"out_main": _err(out_m, sh(ro_m), dt), "out_joint": _err(out_j, ro_j.index_select(1, share), dt)}
    if return_lse:
        rl_m = rl[:, :, J:] if strategy == "front" else rl[:, :, :S]
        rl_j = rl[:, :, :J] if strategy == "front" else rl[:, :, S:]
        lse_j, lse_m = (lse[:, :, :jn], lse[:, :, jn:]) if strategy == "front" else \
            (lse[:, :, lse.shape[2] - jn:], lse[:, :, :lse.shape[2] - jn])
        errs["lse_main"] = _err(lse_m, usp_hal.shard(rl_m, layout=layout, mesh=mesh, seq_dim=2), dt, lse=True)
        errs["lse_joint"] = _err(lse_j, rl_j.index_select(2, share), dt, lse=True)
    if grad:
        dl = torch.cat([dout_joint.index_select(1, share), sh(dout_main)], 1) if strategy == "front" else \
            torch.cat([sh(dout_main), dout_joint.index_select(1, share)], 1)
        out.backward(dl)
        for name, t, r in zip(("dq", "dk", "dv"), loc, leaves[:3]):
            errs[name] = _err(t.grad, sh(r.grad), dt)
        errs["djq"] = _err(jql.grad, leaves[3].grad.index_select(1, share), dt)
        for name, t, r in (("djk", jkl, leaves[4]), ("djv", jvl, leaves[5])):
            total = t.grad.double().clone()
            dist.all_reduce(total, group=mesh.sp_group)    # every rank's part of the replicated tensor
            errs[name] = _err(total, r.grad, dt)
        if sink_loc is not None and sink_ref is not None:
            total = sink_loc.grad.double().clone()
            dist.all_reduce(total, group=mesh.sp_group)
            errs["dsinks"] = _err(total, sink_ref.grad, dt)
    return errs


def joint_refusal(U=2, R=1, what="share"):
    mesh = get_mesh(U, R)
    x = torch.randn(1, 4, 2, 8)
    jq = torch.randn(1, 3 if what == "share" else 2, 2, 8)
    jk = torch.randn(1, 4, 2, 8)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    strategy = "middle" if what == "strategy" else "front"
    cu = [0, 3, 8] if what == "cu_seqlens" else None
    try:
        attn(x, x, x, joint_tensor_query=jq, joint_tensor_key=jk, joint_tensor_value=jk, joint_strategy=strategy,
             cu_seqlens=cu)
        return None
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
