"""The per-batch degree (:mod:`usp_hal.dynamic`) for a transformers model: its shape read from
the config, packing decided from its layers, and the layout to register.

    dd = usp.dynamic_degree(model, budget_tokens=16384, profile="h100-nvlink")
    name = usp.register(mesh=None, layout=usp.DYNAMIC_LAYOUT)      # serves every job of a schedule
    model.set_attn_implementation(name)
    for job in dd.my_jobs(dd.schedule(my_lengths)):
        with dd.on(job) as mesh:
            batch = usp.shard_batch(batch_of(job), mesh, job.cost.layout, cu_seqlens=job.cu_seqlens)
            ...
"""
from __future__ import annotations

import logging
from typing import Optional

from usp_hal.dynamic import DynamicDegree
from usp_hal.stepcost import AttentionShape

from .batch import shard_batch

logger = logging.getLogger(__name__)

#: the layout to register for a schedule's jobs: a ring's jobs run ``varlen_zigzag`` (each
#: document, or the one sequence, cut zigzag-like), a Ulysses group or one rank keeps the order,
#: which ``varlen_zigzag`` on a ring of one is too
DYNAMIC_LAYOUT = "varlen_zigzag"

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64"}


def packing_problem(model) -> Optional[str]:
    """Why packed documents must not share a model call of ``model`` (None when they may): a
    layer that mixes positions outside attention (a recurrence, a convolution) runs its own
    kernel on a one-rank job, and transformers' torch fallbacks of those kernels cannot keep
    packed documents apart."""
    from usp_hal.integrations.sequence_mixers import find_sequence_mixers
    found = find_sequence_mixers(model)
    if not found:
        return None
    names = sorted({f.cls for f in found})
    return (f"its layers {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} mix positions outside attention "
            "and their one-rank kernels cannot keep packed documents apart")


def model_shape(model, dtype: Optional[str] = None) -> AttentionShape:
    """``model``'s shape as the schedule prices it (its config; ``dtype``: default the
    parameters')."""
    if dtype is None:
        p = next(iter(model.parameters()), None)
        dtype = _DTYPES.get(str(p.dtype), "fp32") if p is not None else "fp32"
    return AttentionShape.from_config(model.config, dtype=dtype)


def dynamic_degree(model, *, budget_tokens: int, profile="h100-nvlink", dtype: Optional[str] = None,
                   pack: Optional[bool] = None, **kwargs) -> DynamicDegree:
    """A :class:`usp_hal.dynamic.DynamicDegree` for ``model``: its whole-step shape from the
    config (:func:`model_shape`) and packing from its layers (:func:`packing_problem`:
    ``pack=None`` packs when the layers allow and logs why not otherwise; ``pack=True`` for a
    model that cannot pack raises here, on every rank alike, before any data moves).  Other
    keywords go to DynamicDegree."""
    why = packing_problem(model)
    if pack is None:
        pack = why is None
        if why:
            logger.info("usp_hal: the per-batch degree runs each sequence of this model as a job of its own "
                        "(pack=False): %s", why)
    elif pack and why:
        raise ValueError(f"dynamic_degree(pack=True): this model cannot pack documents into one call: {why}; "
                         "pass pack=False (or leave it out)")
    return DynamicDegree(model_shape(model, dtype), budget_tokens=budget_tokens, profile=profile, pack=bool(pack),
                         **kwargs)


def calibrate_calls(model, dd: DynamicDegree, *, reps: int = 3, tokens: int = 16) -> dict:
    """The model path's fixed cost per call on each split of ``dd`` against what its profile
    prices: a tiny job (``tokens`` per rank) of ``model`` on every group of a split at once,
    forward and backward through this integration (``model`` registered with ``mesh=None``),
    the slowest rank's median time less the price of that job (negative where the profile's
    per-call parts overstate this path, down to all of them).  What it measures is real on
    any machine (each call's agreements, the integration's checks, Python); what it adds
    depends on the machine: a few milliseconds per call on CPU ranks sharing cores.  Returns
    ``{"g,u,r": seconds}``, the same on every rank, and puts it in ``dd``'s price model (its
    ``call_extra``), so schedules made after it price it.  Every rank must call it (it runs
    collectives); the gradients it leaves are zeroed."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from usp_hal.schedule import Job
    sch = dd.scheduler
    m = sch.model
    out = {}
    vocab = int(getattr(model.config, "vocab_size", 2))
    m.call_extra.clear()
    m._jobs.clear()
    for (g, u, r) in sorted(dd.meshes):
        n = tokens * g
        cost = m.job((n,), g, u, sch.layout(g, u))
        block = dd.rank // g
        job = Job((0,), (n,), block * g, g, cost)
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(block))
        ts = []
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            with dd.on(job) as job_mesh:
                batch = shard_batch({"input_ids": ids, "labels": ids}, job_mesh, job.cost.layout)
                model(**batch).loss.backward()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            ts.append(float(took))
        # what the call took beyond its price (less, where the price's per-call parts overstate
        # this path: never below taking all of them back)
        extra = max(-cost.overhead, statistics.median(ts[1:]) - cost.time)
        out[f"{g},{u},{r}"] = extra
    m.call_extra.update({(int(k.split(",")[0]), int(k.split(",")[1])): v for k, v in out.items()})
    m._jobs.clear()
    model.zero_grad(set_to_none=True)
    return out
