"""flash-linear-attention (fla) kernels as the per-rank kernel of state passing.

fla's gated DeltaNet and KDA kernels take ``initial_state`` and return the final state, in the
layout :mod:`usp_hal.mixers.state_passing` works in (``[B, T, H, d]`` tensors, state ``[B, HV, dk,
dv]``).  That is the whole seam: :func:`gated_delta_rule` runs usp-hal's state passing
(every rank keeps its tokens and all heads; only ``[P | S]`` states travel, one all-gather)
with one of fla's kernels on each contiguous piece of a rank's sequence::

    from usp_hal.integrations import fla as usp_fla
    out = usp_fla.gated_delta_rule(q, k, v, g, beta, mesh=mesh, layout="zigzag",
                                   kernel="chunk_gated_delta_rule")      # or "chunk_kda" (g [B, T, HV, dk])

Kernels (:data:`KERNELS`): fla's Triton ones (``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``, ``chunk_kda``, ``fused_recurrent_kda``; they need a GPU)
and its plain torch references (``naive_*``; fp32 inside, they run on the CPU), or any callable
with the signature of fla's ``chunk_gated_delta_rule`` (``kernel(q, k, v, g, beta, *,
initial_state, output_final_state, **kernel_kwargs) -> (out, final_state)``).  Importing this
module imports nothing from fla; the kernel is looked up on the first call.

GVA (fewer q/k heads ``H`` than value heads ``HV``, as Qwen3-Next's gated DeltaNet): value head
``j`` reads q/k head ``j // (HV / H)``, as fla's Triton kernels index them
(fla 0.6.0 fla/ops/gated_delta_rule/fused_recurrent.py: ``i_h = i_hv // (HV // H)``) and as its
naive KDA kernels expand them (fla/ops/kda/naive.py: ``q.repeat_interleave(G, dim=2)``).
fla's layers hand the kernel q/k with ``H`` heads and v, g, beta with ``HV``
(fla/layers/gated_deltanet.py), so do the same here.  fla's naive gated-delta-rule kernels
do not take GVA (their recurrence indexes every input by the same head); for them q and k are
repeated the same way before the call.  A callable gets q and k as they are.

Agreed across the ranks before any state moves, with the rest of the call (shapes, layout,
lengths): the kernel (its name, or a callable's qualified name) and every keyword with its
value (:func:`usp_hal.mixers.state_passing.kernel_settings`; a tensor argument by shape, dtype and a
digest of its values, read to the host once per tensor version).  A rank with another kernel
or argument, and any rank's refusal below, raise the same error on every rank.

Refused on every rank before any collective: an unknown kernel name; a keyword the named
kernel does not take (when its signature lists them all); q/k heads that do not divide the
value heads; a Triton kernel on CPU tensors (Triton has no CPU driver: fla fails with
``RuntimeError: 0 active drivers``; the error names the ``naive_*`` kernel to pass); and, as
kernel keywords, ``cu_seqlens``/``cu_seqlens_cpu``/``chunk_indices`` (pass the global document
boundaries as ``cu_seqlens=`` to :func:`gated_delta_rule`: state passing cuts the pieces at
them and restarts each document from zero), ``cp_context`` (fla's own context parallel: it
would split the sequence a second time), ``state_v_first`` and ``return_intermediate_states``
(another state layout / other outputs than ``(out, final_state)``), and ``initial_state``/
``output_final_state`` (state passing sets them).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

__all__ = ["KERNELS", "kernel", "gated_delta_rule"]


class FlaKernel(NamedTuple):
    module: str
    function: str
    beta_first: bool        # its signature takes beta before g
    whole_chunks: bool      # its length must be a multiple of chunk_size
    triton: bool            # a Triton kernel: device tensors only
    gva: bool               # takes fewer q/k heads than value heads itself
    on_cpu: Optional[str]   # the plain torch kernel of the same recurrence


_GDN, _GDN_NAIVE, _KDA, _KDA_NAIVE = ("fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.naive", "fla.ops.kda",
                                      "fla.ops.kda.naive")
KERNELS: Dict[str, FlaKernel] = {
    "chunk_gated_delta_rule": FlaKernel(_GDN, "chunk_gated_delta_rule", False, False, True, True,
                                        "naive_chunk_gated_delta_rule"),
    "fused_recurrent_gated_delta_rule": FlaKernel(_GDN, "fused_recurrent_gated_delta_rule", False, False, True, True,
                                                  "naive_recurrent_gated_delta_rule"),
    "naive_chunk_gated_delta_rule": FlaKernel(_GDN_NAIVE, "naive_chunk_gated_delta_rule", False, False, False, False,
                                              None),
    # fla 0.6.0 fla/ops/gated_delta_rule/naive.py: naive_recurrent_gated_delta_rule(q, k, v, beta, g, ...)
    "naive_recurrent_gated_delta_rule": FlaKernel(_GDN_NAIVE, "naive_recurrent_gated_delta_rule", True, False, False,
                                                  False, None),
    "chunk_kda": FlaKernel(_KDA, "chunk_kda", False, False, True, True, "naive_chunk_kda"),
    "fused_recurrent_kda": FlaKernel(_KDA, "fused_recurrent_kda", False, False, True, True, "naive_recurrent_kda"),
    # fla 0.6.0 fla/ops/kda/naive.py asserts T % chunk_size == 0: pieces are zero-padded at the end
    # (k = beta = g = 0 there leaves the state as it was; those rows of the output are dropped)
    "naive_chunk_kda": FlaKernel(_KDA_NAIVE, "naive_chunk_kda", False, True, False, True, None),
    "naive_recurrent_kda": FlaKernel(_KDA_NAIVE, "naive_recurrent_kda", False, False, False, True, None),
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
_SET_BY_STATE_PASSING = ("q", "k", "v", "g", "beta", "initial_state", "output_final_state")

KernelArg = Union[str, Callable]


def _lookup(name_or_fn: KernelArg) -> Tuple[Optional[Callable], Optional[FlaKernel], str, Optional[str]]:
    """(the function, its :data:`KERNELS` entry or None for a callable, its name, a problem)."""
    if callable(name_or_fn):
        return name_or_fn, None, getattr(name_or_fn, "__name__", type(name_or_fn).__name__), None
    if not isinstance(name_or_fn, str) or name_or_fn not in KERNELS:
        return None, None, str(name_or_fn), (
            f"unknown kernel {name_or_fn!r}; known: {', '.join(KERNELS)} (or pass a callable with the signature of "
            "fla's chunk_gated_delta_rule)")
    spec = KERNELS[name_or_fn]
    try:
        fn = getattr(importlib.import_module(spec.module), spec.function)
    except (ImportError, AttributeError) as exc:
        return None, spec, name_or_fn, (f"cannot import fla's {name_or_fn} ({type(exc).__name__}: {exc}); install "
                                        "flash-linear-attention (and triton, which its ops import)")
    return fn, spec, name_or_fn, None


def _keyword_problem(fn: Callable, name: str, kernel_kwargs: Dict[str, Any]) -> Optional[str]:
    bad = sorted(set(kernel_kwargs) & set(_REFUSED))
    if bad:
        return "; ".join(f"{k}: {_REFUSED[k]}" for k in bad)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):       # a builtin or C function: its keywords are not listed
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    unknown = sorted(set(kernel_kwargs) - set(params))
    if unknown:
        takes = [p for p in params if p not in _SET_BY_STATE_PASSING and p not in _REFUSED]
        return (f"{name} takes no keyword {', '.join(map(repr, unknown))} (its keywords: "
                f"{', '.join(takes) or 'none'})")
    return None


def _problem(fn: Optional[Callable], spec: Optional[FlaKernel], name: str, kernel_kwargs: Dict[str, Any],
             tensors) -> Optional[str]:
    """What keeps this kernel from running these tensors here, from the arguments alone."""
    if fn is None:
        return None
    found = _keyword_problem(fn, name, kernel_kwargs)
    if found:
        return found
    q, k, v = tensors[:3]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None           # the state passing's own checks name the shapes
    if q.shape[2] != k.shape[2]:
        return f"q and k must have the same number of heads (fla's convention), got {q.shape[2]} and {k.shape[2]}"
    if v.shape[2] % k.shape[2]:
        return (f"the value heads ({v.shape[2]}) are not a multiple of the q/k heads ({k.shape[2]}): fla's GVA "
                "gives each q/k head HV / H value heads")
    if spec is not None and spec.triton and any(t.device.type == "cpu" for t in tensors
                                                if isinstance(t, torch.Tensor)):
        return _cpu_refusal(name, spec)
    return None


def _cpu_refusal(name: str, spec: FlaKernel) -> str:
    return (f"fla's {name} is a Triton kernel and these tensors are on the CPU, which Triton has no driver for "
            f"(fla fails there with 'RuntimeError: 0 active drivers'); on the CPU pass kernel={spec.on_cpu!r} "
            "(fla's torch reference of the same recurrence, fp32 inside), or move the tensors to a GPU")


def _runner(fn: Callable, spec: Optional[FlaKernel], name: str, kernel_kwargs: Dict[str, Any]) -> Callable:
    beta_first = spec.beta_first if spec else False
    whole_chunks = spec.whole_chunks if spec else False
    expand = spec is not None and not spec.gva

    def run(q, k, v, g, beta, initial_state=None, output_final_state=True, **extra):
        if spec is not None and spec.triton and q.device.type == "cpu":
            raise RuntimeError(f"usp_hal.integrations.fla: {_cpu_refusal(name, spec)}")
        kw = {**kernel_kwargs, **extra}
        if expand and k.shape[2] != v.shape[2]:
            # GVA for a kernel without it: value head j reads q/k head j // (HV / H), as fla's own kernels do
            q, k = (t.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for t in (q, k))
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


def kernel(name: KernelArg = "chunk_gated_delta_rule", **kernel_kwargs: Any) -> Callable:
    """fla's kernel ``name`` (or a callable with its signature) as state passing's per-rank
    kernel: ``run(q, k, v, g, beta, initial_state=None, output_final_state=True) -> (out,
    final_state)``.  ``kernel_kwargs`` (e.g. ``use_qk_l2norm_in_kernel=True``, ``scale=``,
    ``chunk_size=``) go to every call; the keywords that would break state passing, and those
    the named kernel does not take, are refused here (ValueError; module docstring)."""
    fn, spec, label, problem = _lookup(name)
    problem = problem or (_keyword_problem(fn, label, kernel_kwargs) if fn is not None else None)
    if problem:
        raise ValueError(f"usp_hal.integrations.fla: {problem}")
    assert fn is not None
    return _runner(fn, spec, label, kernel_kwargs)


# eager under torch.compile (a graph break): every rank runs its collectives from the same eager code
@torch.compiler.disable
def gated_delta_rule(q, k, v, g, beta, *, mesh, layout: str = "basic", cu_seqlens=None,
                     kernel: KernelArg = "chunk_gated_delta_rule", seqlen: Optional[int] = None,
                     **kernel_kwargs: Any):
    """Gated DeltaNet (``g [B, T, HV]``) or KDA (``g [B, T, HV, dk]`` with a ``*_kda`` kernel)
    over the sequence-parallel group by state passing, with fla's ``kernel`` (a name of
    :data:`KERNELS` or a callable) on each piece; q, k ``[B, T, H, dk]``, v ``[B, T, HV, dv]``,
    beta ``[B, T, HV]`` are this rank's tokens (``usp_hal.shard(x, layout=...,
    cu_seqlens=...)``), the output is ``[B, T, HV, dv]`` in local order.  The kernel and its
    arguments are agreed across the ranks (module docstring).  See
    :func:`usp_hal.mixers.state_passing.gated_delta_rule`."""
    from usp_hal.mixers import state_passing
    from usp_hal.mixers.state_passing import kernel_settings
    fn, spec, label, problem = _lookup(kernel)
    problem = problem or _problem(fn, spec, label, kernel_kwargs, (q, k, v, g, beta))
    settings = kernel_settings(f"fla.{kernel}" if isinstance(kernel, str) else kernel, kernel_kwargs)
    # the module-level kernel(): resolved once the arguments passed every check above
    run = globals()["kernel"](kernel, **kernel_kwargs) if not problem else _unrunnable
    key_dim = k.shape[-1] if isinstance(k, torch.Tensor) and k.dim() else 0
    return state_passing.state_passing(run, [q, k, v, g, beta], value_index=2, key_dim=key_dim, mesh=mesh,
                                       layout=layout, cu_seqlens=cu_seqlens, seqlen=seqlen, settings=settings,
                                       problem=problem)


def _unrunnable(*args, **kwargs):
    raise AssertionError("a refused call reached its kernel")       # the agreement raises first
