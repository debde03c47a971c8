"""Ascend NPU (``torch-npu``, import ``torch_npu``): fused attention with backward.

Kernel entry points (input_layout ``"BSND"`` = the contract's ``[B, S, N, D]``)::

    torch_npu.npu_fusion_attention(q, k, v, head_num, "BSND", atten_mask=, scale=,
        keep_prob=, pre_tockens=, next_tockens=, sparse_mode=, ...)
        -> (out, softmax_max [B, N, S, 8], softmax_sum [B, N, S, 8], reserved, seed, offset, numels)
    torch_npu.npu_fusion_attention_grad(q, k, v, dy, head_num, "BSND", atten_mask=,
        softmax_max=, softmax_sum=, attention_in=, scale_value=, sparse_mode=, ...)
        -> (dq, dk, dv, dpse[, dsink ...])

What the adapter does to meet the contract:

* **lse** = ``softmax_max[..., 0] + log(softmax_sum[..., 0])`` (natural log; the eight
  lanes of the last axis are copies).
* **Causal** goes through ``sparse_mode=2`` (top-left, the contract's alignment) with the
  compressed 2048x2048 upper-triangular bool mask (True = masked out).  Without a mask
  the kernel ignores ``sparse_mode`` and attends to everything, so the mask is never left
  out.
* **Scale** is ``scale`` in the forward but ``scale_value`` in the grad op.
* **Backward with a global lse**: the grad op rebuilds probabilities as
  ``exp(s - softmax_max) / softmax_sum``.  The adapter passes ``softmax_max = lse`` and
  ``softmax_sum = 1``, which is the same softmax for the block's own lse and the correct
  ring-backward probabilities for a merged one; rows whose lse is ``-inf`` get ``+inf``
  there and so contribute nothing.
* The grad op's output count has grown across releases (``dsink`` and more): the
  adapter takes ``dq, dk, dv`` by index.
* **Dropout** is refused: the kernel's dropout needs its forward ``seed/offset/numels``
  again in backward, and the contract carries no RNG state from forward to backward.
  Window, softcap and alibi (``pse``) are not mapped and are refused.
* Limits from the op's documentation (Ascend/op-plugin ``docs/context/
  torch_npu-npu_fusion_attention.md``): head dim 1..768 (``Dq == Dk >= Dv``), at most 256
  query heads, Atlas A2 training products.  The signatures used here are those of
  op-plugin 5.0.0 (``op_plugin_functions.yaml``), which torch-npu 2.1.0 ships: the oldest
  release on PyPI, and the minimum declared.
"""
from __future__ import annotations

import torch

from usp_hal.dispatch import platform as _platform
from usp_hal.dispatch.backend import AttentionBackend, lse_for_backward, normalize_lse
from usp_hal.dispatch.capabilities import Availability, KernelCall, Package

PACKAGE = Package(dist="torch-npu", module="torch_npu", min_version="2.1.0", extra="npu")
DOC = "Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md (0d8f401d, 3ec6c1fc)"

LAYOUT = "BSND"
SPARSE_NONE = 0
SPARSE_LEFT_UP_CAUSAL = 2          # top-left causal, with the compressed mask below
COMPRESSED_MASK_SIZE = 2048
MAX_HEADS = 256                    # the kernel's limit on query heads

_MASKS: dict = {}


def causal_mask(device) -> torch.Tensor:
    """The compressed 2048x2048 upper-triangular bool mask sparse_mode 2 expects (True = masked)."""
    key = str(device)
    mask = _MASKS.get(key)
    if mask is None:
        mask = torch.triu(torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool,
                                     device=device), diagonal=1)
        _MASKS[key] = mask
    return mask


class NPUBackend(AttentionBackend):
    NAME = "npu"
    DESCRIPTION = "Ascend torch_npu.npu_fusion_attention (BSND) with npu_fusion_attention_grad"
    SUPPORTED_DEVICES = frozenset({"npu"})
    SUPPORTED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
    HEAD_DIM_MIN = 1
    HEAD_DIM_MAX = 768
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = False
    SUPPORTS_SOFTCAP = False
    SUPPORTS_ALIBI = False
    SUPPORTS_DROPOUT = False        # no RNG state travels from forward to backward
    SUPPORTS_GQA = True
    RETURNS_LSE = True
    HAS_BACKWARD = True
    REQUIRED_PACKAGES = (PACKAGE,)
    INPUT_LAYOUT = "contiguous"
    UPSTREAM_CHECKED = (
        ("head dim 1..768, Nq <= 256, GQA, sparse_mode 2 = top-left causal with the compressed 2048x2048 mask, "
         "softmax_max/sum [B, N, S, 8], scale vs scale_value", DOC),
        ("signatures of npu_fusion_attention / npu_fusion_attention_grad",
         "Ascend/op-plugin 5.0.0 op_plugin/config/v2r1/op_plugin_functions.yaml"),
    )

    @classmethod
    def not_supported_reasons(cls, request):
        reasons = super().not_supported_reasons(request)
        if request.num_heads > MAX_HEADS:
            reasons.append(f"heads={request.num_heads} > {MAX_HEADS} (npu_fusion_attention limit)")
        return reasons

    @classmethod
    def availability(cls) -> Availability:
        avail = super().availability()
        if (not avail.ok and avail.version is not None
                and "npu" not in _platform.available_device_types() and not hasattr(torch, "npu")):
            return Availability(False, avail.reason + " (torch.npu is not registered: torch_npu was not "
                                "imported; torch >= 2.5 autoloads it unless TORCH_DEVICE_BACKEND_AUTOLOAD=0)",
                                avail.version)
        return avail

    @staticmethod
    def _mask_args(q, causal) -> dict:
        if causal:
            return {"atten_mask": causal_mask(q.device), "sparse_mode": SPARSE_LEFT_UP_CAUSAL}
        return {"atten_mask": None, "sparse_mode": SPARSE_NONE}

    def kernel_forward(self, q, k, v, call: KernelCall):
        import torch_npu

        res = torch_npu.npu_fusion_attention(
            q, k, v, q.shape[2], LAYOUT, scale=call.scale, keep_prob=1.0, **self._mask_args(q, call.causal))
        out, smax, ssum = res[0], res[1], res[2]
        lse = smax[..., 0].float() + torch.log(ssum[..., 0].float())
        return out, normalize_lse(lse)

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        b, sq, h, _ = q.shape
        row_max = lse_for_backward(lse).float().unsqueeze(-1).expand(b, h, sq, 8).contiguous()
        row_sum = torch.ones_like(row_max)
        import torch_npu

        res = torch_npu.npu_fusion_attention_grad(
            q, k, v, dout.to(q.dtype).contiguous(), h, LAYOUT,
            softmax_max=row_max, softmax_sum=row_sum, attention_in=out.to(q.dtype).contiguous(),
            scale_value=call.scale, keep_prob=1.0, **self._mask_args(q, call.causal))
        return res[0], res[1], res[2]
