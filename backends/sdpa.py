"""torch SDPA through the aten ops that return a log-sum-exp.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (natural-log lse,
memory order [B, S, H], 0 for fully masked rows: normalised here).  Window, alibi and ring
position offsets are applied through a float mask, so they stay exact across ring blocks.

CUDA/ROCm: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, no mask) or
``aten._scaled_dot_product_efficient_attention`` (with a bias for window/alibi), with the
efficient kernel's lse padding (a multiple of 32 on CUDA) and cuDNN's trailing dim removed
by :func:`normalize_cuda_lse`.
"""
from __future__ import annotations

import torch

from usp_hal.backend import AttentionBackend, lse_for_backward, normalize_lse, position_mask
from usp_hal.platform import device_type_of

_HALF = (torch.float16, torch.bfloat16)


def normalize_cuda_lse(lse: torch.Tensor, sq: int) -> torch.Tensor:
    """Efficient-attention pads lse to ceil(Sq/32)*32; cuDNN returns [B, H, Sq, 1]."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :sq]


class SDPABackend(AttentionBackend):
    NAME = "sdpa"
    DESCRIPTION = "torch scaled_dot_product_attention (aten flash/efficient ops with lse)"
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda", "rocm"})
    SUPPORTED_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})
    SUPPORTS_WINDOW = True
    SUPPORTS_ALIBI = True
    SUPPORTS_KEY_OFFSET = True
    SUPPORTS_GQA = True
    RETURNS_LSE = True
    HAS_BACKWARD = True
    IS_DETERMINISTIC = True   # on CPU; see extra_reasons for CUDA

    @classmethod
    def extra_reasons(cls, req):
        reasons = []
        if req.device_type != "cpu":
            if req.dtype == torch.float64:
                reasons.append(f"fp64 is only supported on cpu (device={req.device_type})")
            if req.deterministic and req.needs_grad:
                reasons.append("the CUDA efficient-attention backward is not deterministic")
        return reasons

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _needs_mask(window, alibi_slopes, key_offset) -> bool:
        return tuple(window) != (-1, -1) or alibi_slopes is not None

    def _mask(self, q, k, causal, window, key_offset, alibi_slopes, dtype):
        return position_mask(q.shape[1], k.shape[1], causal=causal, window=window, key_offset=key_offset,
                             alibi_slopes=alibi_slopes, batch=q.shape[0], heads=q.shape[2],
                             dtype=dtype, device=q.device)

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        if softcap:
            raise NotImplementedError("sdpa: softcap is not supported (use fa2/fa3)")
        if dropout_p:
            raise NotImplementedError("sdpa: dropout_p > 0 is not supported by the lse-returning ops")
        dev = device_type_of(q.device)
        if dev == "cpu":
            return self._forward_cpu(q, k, v, softmax_scale, causal, window, alibi_slopes, key_offset)
        return self._forward_cuda(q, k, v, softmax_scale, causal, window, alibi_slopes, key_offset)

    def _compute_dtype(self, q, alibi_slopes):
        # an alibi bias in bf16/fp16 loses integer distances; compute those calls in fp32
        return torch.float32 if (alibi_slopes is not None and q.dtype in _HALF) else q.dtype

    def _forward_cpu(self, q, k, v, scale, causal, window, alibi_slopes, key_offset):
        cdt = self._compute_dtype(q, alibi_slopes)
        qt, kt, vt = (x.to(cdt).transpose(1, 2) for x in (q, k, v))
        empty = None
        if self._needs_mask(window, alibi_slopes, key_offset):
            mask, empty = self._mask(q, k, causal, window, key_offset, alibi_slopes, cdt)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, False, attn_mask=mask, scale=scale)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, scale=scale)
        return out.transpose(1, 2).to(q.dtype), normalize_lse(lse, empty)

    def _forward_cuda(self, q, k, v, scale, causal, window, alibi_slopes, key_offset):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kt, vt = _repeat_kv(kt, qt.shape[1]), _repeat_kv(vt, qt.shape[1])
        sq = q.shape[1]
        if not self._needs_mask(window, alibi_slopes, key_offset) and q.dtype in _HALF:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
            return res[0].transpose(1, 2), normalize_lse(normalize_cuda_lse(res[1], sq))
        bias, empty = (None, None)
        if self._needs_mask(window, alibi_slopes, key_offset):
            bias, empty = self._mask(q, k, causal, window, key_offset, alibi_slopes, q.dtype)
            bias = bias.expand(q.shape[0], q.shape[2], sq, k.shape[1])
            causal = False
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, bias, True, 0.0, causal, scale=scale)
        return res[0].transpose(1, 2), normalize_lse(normalize_cuda_lse(res[1], sq), empty)

    # ------------------------------------------------------------------ backward
    def backward(self, dout, q, k, v, out, lse, *, softmax_scale, causal=False, window=(-1, -1),
                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, key_offset=0):
        if softcap or dropout_p:
            raise NotImplementedError("sdpa: softcap/dropout are not supported")
        lse = lse_for_backward(lse)
        if device_type_of(q.device) == "cpu":
            cdt = self._compute_dtype(q, alibi_slopes)
            qt, kt, vt, ot, dot = (x.to(cdt).transpose(1, 2) for x in (q, k, v, out, dout))
            kw = {"scale": softmax_scale}
            if self._needs_mask(window, alibi_slopes, key_offset):
                kw["attn_mask"] = self._mask(q, k, causal, window, key_offset, alibi_slopes, cdt)[0]
                causal = False
            lse = lse.to(torch.float64 if cdt == torch.float64 else torch.float32)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, causal, **kw)
            return tuple(g.transpose(1, 2).to(q.dtype) for g in (dq, dk, dv))
        return self._backward_cuda(dout, q, k, v, out, lse, softmax_scale, causal, window, alibi_slopes, key_offset)

    def _backward_cuda(self, dout, q, k, v, out, lse, scale, causal, window, alibi_slopes, key_offset):
        hkv = k.shape[2]
        qt, ot, dot = (x.transpose(1, 2) for x in (q, out, dout))
        kt, vt = _repeat_kv(k.transpose(1, 2), q.shape[2]), _repeat_kv(v.transpose(1, 2), q.shape[2])
        bias = None
        if self._needs_mask(window, alibi_slopes, key_offset):
            bias = self._mask(q, k, causal, window, key_offset, alibi_slopes, q.dtype)[0]
            bias = bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            causal = False
        # the efficient backward wants its own padded lse layout
        pad = (-lse.shape[-1]) % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dot, qt, kt, vt, bias, ot, lse_p, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        dk, dv = _sum_kv(dk, hkv), _sum_kv(dv, hkv)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, H, S, D] for kernels without native GQA."""
    hkv = x.shape[1]
    return x if hkv == heads else x.repeat_interleave(heads // hkv, dim=1)


def _sum_kv(g: torch.Tensor, hkv: int) -> torch.Tensor:
    b, h, s, d = g.shape
    return g if h == hkv else g.view(b, hkv, h // hkv, s, d).sum(2)
