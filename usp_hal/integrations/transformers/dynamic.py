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

logger = logging.getLogger(__name__)

#: the layout to register for a schedule's jobs: one sequence on a ring runs zigzag (what
#: ``varlen_zigzag`` is without document boundaries), packed documents on a ring are each split
#: zigzag, and a Ulysses group or one rank keeps the order (a ring of one)
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
