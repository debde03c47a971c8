"""flash-linear-attention (fla) kernels as the per-rank kernel of state passing.

fla's gated DeltaNet and KDA kernels take ``initial_state`` and return the final state, in the
layout :mod:`usp_hal.state_passing` works in (``[B, T, H, d]`` tensors, state ``[B, H, dk,
dv]``).  That is the whole seam: :func:`gated_delta_rule` runs usp-hal's state passing
(every rank keeps its tokens and all heads; only ``[P | S]`` states travel, one all-gather)
with one of fla's kernels on each contiguous piece of a rank's sequence::

    from usp_hal.integrations import fla as usp_fla
    out = usp_fla.gated_delta_rule(q, k, v, g, beta, mesh=mesh, layout="zigzag",
                                   kernel="chunk_gated_delta_rule")      # or "chunk_kda" (g [B, T, H, dk])

Kernels (:data:`KERNELS`): fla's Triton ones (``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``, ``chunk_kda``, ``fused_recurrent_kda``; they need a GPU)
and its plain torch references (``naive_*``; fp32 inside, they run on the CPU).  Importing this
module imports nothing from fla; the kernel is looked up on the first call.

Refused from the arguments alone, before any collective (:func:`kernel`): ``cu_seqlens``/
``cu_seqlens_cpu``/``chunk_indices`` as kernel keywords (pass the global document boundaries as
``cu_seqlens=`` to :func:`gated_delta_rule`: state passing cuts the pieces at them and
restarts each document from zero), ``cp_context`` (fla's own context parallel: it would split
the sequence a second time), ``state_v_first`` and ``return_intermediate_states`` (another state
layout / other outputs than ``(out, final_state)``), and ``initial_state``/
``output_final_state`` (state passing sets them).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["KERNELS", "kernel", "gated_delta_rule"]

# name: (module, function, its signature takes beta before g, its length must be a multiple of chunk_size)
KERNELS: Dict[str, Tuple[str, str, bool, bool]] = {
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", False, False),
    "fused_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", False, False),
    "naive_chunk_gated_delta_rule": ("fla.ops.gated_delta_rule.naive", "naive_chunk_gated_delta_rule", False, False),
    # fla 0.6.0 fla/ops/gated_delta_rule/naive.py: naive_recurrent_gated_delta_rule(q, k, v, beta, g, ...)
    "naive_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule.naive", "naive_recurrent_gated_delta_rule",
                                         True, False),
    "chunk_kda": ("fla.ops.kda", "chunk_kda", False, False),
    "fused_recurrent_kda": ("fla.ops.kda", "fused_recurrent_kda", False, False),
    # fla 0.6.0 fla/ops/kda/naive.py asserts T % chunk_size == 0: pieces are zero-padded at the end
    # (k = beta = g = 0 there leaves the state as it was; those rows of the output are dropped)
    "naive_chunk_kda": ("fla.ops.kda.naive", "naive_chunk_kda", False, True),
    "naive_recurrent_kda": ("fla.ops.kda.naive", "naive_recurrent_kda", False, False),
}

_REFUSED = {
    "cu_seqlens": "pass the global document boundaries as cu_seqlens= to usp_hal.integrations.fla.gated_delta_rule "
                  "(state passing cuts the pieces at them and starts each document from a zero state)",
    "cu_seqlens_cpu": "pass the global document boundaries as cu_seqlens= to gated_delta_rule instead",
    "chunk_indices": "pass the global document boundaries as cu_seqlens= to gated_delta_rule instead",
    "cp_context": "fla's own context parallel would split the already sharded sequence again; usp-hal's state "
                  "passing is the context parallel here (leave cp_context out)",
    "state_v_first": "state passing builds states [B, H, dk, dv]; leave state_v_first at False",
    "return_intermediate_states": "state passing needs (out, final_state) from the kernel; leave it False",
    "initial_state": "state passing sets the initial state of every piece itself",
    "output_final_state": "state passing asks for the final state itself",
}


def kernel(name: str = "chunk_gated_delta_rule", **kernel_kwargs: Any) -> Callable:
    """fla's kernel ``name`` as state passing's per-rank kernel: ``run(q, k, v, g, beta,
    initial_state=None, output_final_state=True) -> (out, final_state)``.  ``kernel_kwargs``
    (e.g. ``use_qk_l2norm_in_kernel=True``, ``scale=``, ``chunk_size=``) go to every call;
    the keywords that would break state passing are refused (module docstring)."""
    if name not in KERNELS:
        raise ValueError(f"usp_hal.integrations.fla: unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    bad = sorted(set(kernel_kwargs) & set(_REFUSED))
    if bad:
        raise ValueError("usp_hal.integrations.fla: " + "; ".join(f"{k}: {_REFUSED[k]}" for k in bad))
    module, fn_name, beta_first, whole_chunks = KERNELS[name]
    fn = getattr(importlib.import_module(module), fn_name)

    def run(q, k, v, g, beta, initial_state=None, output_final_state=True, **extra):
        kw = {**kernel_kwargs, **extra}
        if whole_chunks:
            T = q.shape[1]
            pad = -T % int(kw.get("chunk_size", 64))
            if pad:
                q, k, v, g, beta = (torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
                                    for x in (q, k, v, g, beta))
                out, final = fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                                **kw)
                return out[:, :T], final
        if beta_first:
            return fn(q, k, v, beta, g, initial_state=initial_state, output_final_state=output_final_state, **kw)
        return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state, **kw)
    run.__name__ = f"fla_{name}"
    return run


def gated_delta_rule(q, k, v, g, beta, *, mesh, layout: str = "basic", cu_seqlens=None,
                     kernel: str = "chunk_gated_delta_rule", seqlen: Optional[int] = None, **kernel_kwargs: Any):
    """Gated DeltaNet (``g [B, T, H]``) or KDA (``g [B, T, H, dk]`` with a ``*_kda`` kernel) over
    the sequence-parallel group by state passing, with fla's ``kernel`` on each piece; inputs
    are this rank's tokens (``usp_hal.shard(x, layout=..., cu_seqlens=...)``), the output is
    ``[B, T, H, dv]`` in local order.  See :func:`usp_hal.state_passing.gated_delta_rule`."""
    from usp_hal import state_passing
    # resolved from the call's arguments alone (no collective): ranks called alike refuse alike
    run = globals()["kernel"](kernel, **kernel_kwargs)
    return state_passing.gated_delta_rule(q, k, v, g, beta, mesh=mesh, layout=layout, cu_seqlens=cu_seqlens,
                                          kernel=run, seqlen=seqlen)

