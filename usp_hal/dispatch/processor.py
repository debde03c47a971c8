"""A user kernel given as ``attn_processor`` (yunchang's custom-kernel hook), as a backend."""
from __future__ import annotations

import torch

from . import platform as _platform
from .backend import AttentionBackend
from .capabilities import KernelCall


def processor_backend(processor, flash_style: bool = False) -> "type[AttentionBackend]":
    """A backend class whose kernel is ``processor``, with one of the two contracts yunchang
    0.6.4 gives an ``attn_processor`` (yunchang/kernels/__init__.py ``select_flash_attn_impl``,
    the ring's "fwd-only" stage; q/k/v ``[B, S, H, D]``):

    * ``flash_style=False`` (its ``SPARSE_SAGE`` branch): ``processor(q, k, v, is_causal=causal,
      scale=softmax_scale, tensor_layout="NHD")`` returns the output alone, so, as there, it runs
      only where one kernel call sees every key (ring degree 1);
    * ``flash_style=True`` (its last branch, an ``attn_type`` that is none of its members):
      ``processor(q, k, v, **call.flash_kwargs(), return_softmax=False)`` (flash-attn's keywords,
      :meth:`usp_hal.dispatch.capabilities.KernelCall.flash_kwargs`) returns
      ``(out, lse [B, H, S] float32)``, which the ring merges, so any ring degree runs.

    Forward only in both (yunchang's backward picks its kernel by ``attn_type`` alone); the
    backend declares no option beyond causal masking, so a call that needs gradients or any
    other option is refused with the reason."""
    if not callable(processor):
        raise TypeError(f"attn_processor must be callable (a torch.nn.Module), got {type(processor).__name__}")

    class AttnProcessorBackend(AttentionBackend):
        NAME = f"attn_processor:{getattr(processor, '__name__', type(processor).__name__)}"
        DESCRIPTION = "a user kernel given as attn_processor (yunchang's contract, forward only)"
        SUPPORTED_DEVICES = frozenset(_platform.PLATFORMS)
        SUPPORTED_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})
        SUPPORTS_GQA = False
        RETURNS_LSE = flash_style
        HAS_BACKWARD = False
        SUPPORTS_VARLEN = False

        def kernel_forward(self, q, k, v, call: KernelCall):
            if flash_style:
                out, lse = processor(q, k, v, **call.flash_kwargs(), return_softmax=False)[:2]
                return out, lse
            return processor(q, k, v, is_causal=call.causal, scale=call.scale, tensor_layout="NHD"), None

    AttnProcessorBackend.processor = processor      # type: ignore[attr-defined]
    return AttnProcessorBackend


def processor_attn_type(processor, attn_type) -> "type[AttentionBackend]":
    """The backend a module runs when given ``attn_processor``, as yunchang 0.6.4 hands it the
    call: for ``AttnType.SPARSE_SAGE`` the output-only contract; for an ``attn_type`` that is
    none of its members (None; here also "auto") the flash-style one with an lse (see
    :func:`processor_backend`).  For any other member yunchang runs that member's kernel and
    leaves the processor unused: refused here rather than dropped."""
    name = attn_type if attn_type is None or isinstance(attn_type, str) else getattr(attn_type, "name", attn_type)
    low = None if name is None else str(name).lower()
    if low == "sparse_sage":
        return processor_backend(processor)
    if low in (None, "auto", "none"):
        return processor_backend(processor, flash_style=True)
    raise ValueError(f"attn_processor was given with attn_type={attn_type!r}: yunchang 0.6.4 runs an "
                     "attn_processor only for AttnType.SPARSE_SAGE (processor(q, k, v, is_causal=, scale=, "
                     "tensor_layout='NHD') -> out) or for an attn_type that is none of its members, such as None "
                     "(processor(q, k, v, dropout_p=, softmax_scale=, causal=, ...) -> (out, lse)), and would leave "
                     "it unused here; pass one of those attn_type values, or drop attn_processor")
