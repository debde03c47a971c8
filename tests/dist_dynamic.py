"""The degree per global batch (usp_hal.dynamic) on every rank of a WorkerPool (tests/mp.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from usp_hal.dynamic import DynamicDegree
from usp_hal.reference import reference_attention
from usp_hal.schedule import AttentionShape

SHAPE = AttentionShape(heads=4, head_dim=8, kv_heads=2, dtype="fp32", causal=True, bwd=True)


def _sequence(i: int, n: int):
    """Sequence ``i``'s q, k, v and output gradient, the same on every rank (seeded by ``i``)."""
    g = torch.Generator().manual_seed(1000 + i)
    return [torch.randn(1, n, h, SHAPE.head_dim, generator=g, dtype=torch.float64)
            for h in (SHAPE.heads, SHAPE.kv_heads, SHAPE.kv_heads, SHAPE.heads)]


def _reference(lengths, seqs):
    """float64 output and q/k/v gradients of each sequence alone, concatenated in job order."""
    outs, grads = [], [[], [], []]
    for i, n in zip(seqs, lengths):
        q, k, v, dout = _sequence(i, n)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out, _ = reference_attention(q, k, v, causal=True)
        out.backward(dout)
        outs.append(out.detach())
        for acc, x in zip(grads, (q, k, v)):
            acc.append(x.grad)
    return torch.cat(outs, 1), [torch.cat(g, 1) for g in grads]


def scheduled_attention(local_lengths, budget: int, sizes=None, profile="cpu-4ranks"):
    """Each rank gives its own sequences; every rank schedules the gathered batch, runs its jobs
    (forward and backward, fp32) on the job's mesh, and compares every job's output and q/k/v
    gradients, unsharded, with float64 attention of each sequence alone."""
    rank = dist.get_rank()
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile=profile, sizes=sizes)
    sched = dd.schedule(local_lengths[rank])
    worst = {"out": 0.0, "grad": 0.0}
    ran = []
    for job in dd.my_jobs(sched):
        with dd.on(job) as mesh:
            attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=job.cost.layout)
            parts = [_sequence(i, n) for i, n in zip(job.seqs, job.lengths)]
            q, k, v, dout = (torch.cat([p[j] for p in parts], 1) for j in range(4))
            cu = job.cu_seqlens
            lay = job.cost.layout
            ql, kl, vl = (usp_hal.shard(x.float(), layout=lay, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
            out = attn(ql, kl, vl, causal=True, cu_seqlens=cu) if cu else attn(ql, kl, vl, causal=True)
            out.backward(usp_hal.shard(dout.float(), layout=lay, cu_seqlens=cu))
            full = usp_hal.unshard(out.detach(), layout=lay, cu_seqlens=cu)
            grads = [usp_hal.unshard(x.grad, layout=lay, cu_seqlens=cu) for x in (ql, kl, vl)]
            assert mesh.sp_ranks == tuple(job.ranks)
        ref, ref_grads = _reference(job.lengths, job.seqs)
        worst["out"] = max(worst["out"], (full.double() - ref).abs().max().item())
        worst["grad"] = max(worst["grad"], max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)))
        ran.append((job.seqs, job.size, job.cost.ulysses, job.cost.ring))
    return {"worst": worst, "ran": ran, "jobs": [(j.seqs, j.first, j.size, j.cost.ulysses, j.cost.ring)
                                                for j in sched.jobs], "meshes": len(dd.meshes)}


def schedule_error(local_lengths=None, global_lengths=None, budget: int = 64):
    """What every rank raises scheduling these lengths (None when it schedules)."""
    rank = dist.get_rank()
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile="cpu-4ranks")
    try:
        if global_lengths is not None:
            dd.schedule(global_lengths[rank], global_batch=True)
        else:
            dd.schedule(local_lengths[rank])
    except Exception as exc:     # noqa: BLE001 - the point is what comes out
        return f"{type(exc).__name__}: {exc}"
    return None
