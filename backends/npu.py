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
"""
from __future__ import annotations

import torch

from usp_hal import platform as _platform
from usp_hal.backend import AttentionBackend, lse_for_backward, normalize_lse
from usp_hal.capabilities import Availability, Package

PACKAGE = Package(dist="torch-npu", module="torch_npu", extra="npu")

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

    @classmethod
    def extra_reasons(cls, request):
        if request.num_heads > MAX_HEADS:
            return [f"heads={request.num_heads} > {MAX_HEADS} (npu_fusion_attention limit)"]
        return []

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
    def _check_call(window, softcap, alibi_slopes, dropout_p):
        if tuple(window) != (-1, -1) or softcap or alibi_slopes is not None or dropout_p:
            raise NotImplementedError(
                "npu: window, softcap, alibi and dropout are not supported by this adapter "
                f"(got window={tuple(window)}, softcap={softcap}, alibi={alibi_slopes is not None}, "
                f"dropout_p={dropout_p}); dropout would need RNG state the contract does not carry")

    @staticmethod
    def _mask_args(q, causal) -> dict:
        if causal:
            return {"atten_mask": causal_mask(q.device), "sparse_mode": SPARSE_LEFT_UP_CAUSAL}
        return {"atten_mask": None, "sparse_mode": SPARSE_NONE}

    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        self._check_call(window, softcap, alibi_slopes, dropout_p)
        scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
        import torch_npu

        res = torch_npu.npu_fusion_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), q.shape[2], LAYOUT,
            scale=scale, keep_prob=1.0, **self._mask_args(q, causal))
        out, smax, ssum = res[0], res[1], res[2]
        lse = smax[..., 0].float() + torch.log(ssum[..., 0].float())
        return out, normalize_lse(lse)

    def backward(self, dout, q, k, v, out, lse, *, softmax_scale, causal=False, window=(-1, -1),
                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, key_offset=0):
        self._check_call(window, softcap, alibi_slopes, dropout_p)
        scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
        b, sq, h, _ = q.shape
        row_max = lse_for_backward(lse).float().unsqueeze(-1).expand(b, h, sq, 8).contiguous()
        row_sum = torch.ones_like(row_max)
        import torch_npu

        res = torch_npu.npu_fusion_attention_grad(
            q.contiguous(), k.contiguous(), v.contiguous(), dout.to(q.dtype).contiguous(), h, LAYOUT,
            softmax_max=row_max, softmax_sum=row_sum, attention_in=out.to(q.dtype).contiguous(),
            scale_value=scale, keep_prob=1.0, **self._mask_args(q, causal))
        return res[0], res[1], res[2]
