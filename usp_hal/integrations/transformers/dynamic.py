"""The per-batch degree (:mod:`usp_hal.planning.dynamic`) for a transformers model: its shape read from
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

from usp_hal.parallel.comm import agree, digest_ints
from usp_hal.parallel.partial_grads import mark_synced
from usp_hal.planning.dynamic import DynamicDegree
from usp_hal.planning.stepcost import AttentionShape

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
    """A :class:`usp_hal.planning.dynamic.DynamicDegree` for ``model``: its whole-step shape from the
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


def calibrate_calls(model, dd: DynamicDegree, *, reps: int = 5, tokens=(16, 256, 1024), doc: int = 32) -> dict:
    """``model``'s own cost per call on each split of ``dd`` against what its profile prices:
    jobs of ``model`` on every group of a split at once (one sequence of each size in
    ``tokens`` per rank, sizes past ``dd``'s budget left out, and the largest as packed
    documents of ``doc`` tokens), forward and backward through this integration (``model``
    registered with ``mesh=None``), each the slowest rank's median time less the price of that
    job.  Every job of every split is timed once per round, the order rotating from round to
    round, so that a drift of the machine's speed falls on all of them alike; the first round
    warms up.  The fit is :func:`usp_hal.planning.stepcost.fit_call_extra`: per split a part
    per call, per token and per packed document, and one factor on the priced attention common
    to every split.
    What it measures is real on any machine (each call's agreements, the integration's checks
    and per-document bookkeeping, Python, the model's own layers against the stand-in the
    profile measured); how much it adds depends on the machine: a few milliseconds per call
    where ranks share cores.  Returns ``{"attention": factor, "g,u,r": [seconds per call,
    seconds per token per rank, seconds per document], ...}``, the same on every rank, and
    puts it in ``dd``'s price model (its ``call_extra`` and ``call_attention``), so schedules
    made after it price it.  Every rank must call it (it runs collectives); the gradients it
    leaves are dropped (``zero_grad(set_to_none=True)``) and its meshes marked synced, so the
    next optimizer step sees none of its backward passes."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from usp_hal.planning.schedule import Job
    from usp_hal.planning.stepcost import fit_call_extra
    sch = dd.scheduler
    m = sch.model
    vocab = int(getattr(model.config, "vocab_size", 2))
    m.set_call_extra({})
    sizes = sorted({min(int(t), sch.budget) for t in tokens})
    problem = None
    if len(sizes) < 2 or sizes[0] < 1:
        problem = (f"tokens={tuple(tokens)} (capped at the budget, {sch.budget}) must give two sizes or more, each "
                   "at least 1 token per rank, to tell the per-call part from the per-token part")
    elif int(reps) < 1 or int(doc) < 1:
        problem = f"reps={reps} and doc={doc} must be at least 1"
    # every rank runs the same jobs, or none does: the settings agreed before the first job
    agree(problem, None, what="calibrate_calls: the jobs", where="default process group",
          values=[] if problem else [int(reps), int(doc), digest_ints(sizes)], width=3,
          same=("reps", "doc", "sizes digest"))
    large = sizes[-1]
    jobs = []                      # (split, tokens per rank, job, ids)
    for (g, u, r) in sorted(dd.meshes):
        block = dd.rank // g
        docs = max(2, large * g // doc)
        for n, lengths in [(t, (t * g,)) for t in sizes] + [(large, tuple([large * g // docs] * docs))]:
            cost = m.job(lengths, g, u, sch.layout(g, u, len(lengths) > 1))
            ids = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(block))
            jobs.append(((g, u, r), n, Job(tuple(range(len(lengths))), lengths, block * g, g, cost), ids))
    times: list = [[] for _ in jobs]
    for rnd in range(reps + 1):
        shift = rnd % len(jobs)
        for k in list(range(shift, len(jobs))) + list(range(shift)):
            _, _, job, ids = jobs[k]
            dist.barrier()
            t0 = time.perf_counter()
            with dd.on(job) as job_mesh:
                cu = list(job.cu_seqlens) if job.cu_seqlens else None
                batch = shard_batch({"input_ids": ids, "labels": ids}, job_mesh, job.cost.layout, cu_seqlens=cu)
                model(**batch).loss.backward()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rnd:
                times[k].append(float(took))
    out = fit_call_extra([(split, n, len(job.lengths), job.cost, statistics.median(ts))
                          for (split, n, job, _), ts in zip(jobs, times)])
    m.set_call_extra(out)
    model.zero_grad(set_to_none=True)
    for mesh in dd.meshes.values():      # its gradients are gone: no optimizer step may see them as pending
        mark_synced(mesh)
    return out
