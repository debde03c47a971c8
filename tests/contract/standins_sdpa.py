"""Stand-ins for the aten CUDA attention ops the sdpa backend calls directly.

:class:`CudaSDPAStandin` has the signatures of ``aten._scaled_dot_product_flash_attention``,
``aten._scaled_dot_product_efficient_attention`` and its backward, computes on CPU tensors,
and enforces the checks the real ops make (each with the source it was read from, pytorch
``aten/src/ATen/native/transformers/cuda/``), on the compute capability that
``usp_hal.dispatch.platform.emulate`` reports.  It is substituted through
``usp_hal.backends.sdpa.cuda_ops``.  It proves the *adapter*, not the kernels.
"""
from __future__ import annotations

import torch

from .standins_misc import attend, attend_grad, positions


def _cc():
    from usp_hal.dispatch import platform
    em = platform.emulated()
    if em is None or em.device_type not in ("cuda", "rocm"):
        raise RuntimeError("stand-in CUDA op called outside platform.emulate('cuda')")
    return em.compute_capability or (9, 0)


class CudaSDPAStandin:
    def __init__(self) -> None:
        self.calls: list = []

    # ------------------------------------------------------------------ flash
    def flash(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        """q/k/v [B, H, S, D].  attention.cu _scaled_dot_product_flash_attention_cuda transposes to
        [B, S, H, D] and calls flash_attn/flash_api.cpp mha_fwd, whose checks follow."""
        self.calls.append(dict(op="flash", dtype=query.dtype, head_dim=query.shape[-1], causal=is_causal))
        cc = _cc()
        if cc[0] < 8:   # flash_api.cpp mha_fwd: is_sm80_or_newer
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        if query.dtype not in (torch.float16, torch.bfloat16):   # mha_fwd
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        for t in (query, key, value):
            if t.stride(-1) != 1:          # mha_fwd: contiguous last dimension
                raise RuntimeError("Input tensor must have contiguous last dimension")
        d = query.shape[-1]
        if d % 8:                          # mha_fwd: the public SDPA pads in pad_last_dim<8>
            raise RuntimeError("head_size must be a multiple of 8, this is ensured by padding!")
        if d > 256:
            raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
        if query.shape[1] % key.shape[1]:
            raise RuntimeError("Number of heads in key/value must divide number of heads in query")
        sq, sk = query.shape[2], key.shape[2]
        sc = scale if scale is not None else d ** -0.5
        keep = None
        if is_causal:                      # vendored FA2: causal aligned bottom-right
            m, n = positions(sq, sk)
            keep = n <= m + (sk - sq)
        out, lse = attend(query, key, value, sc, keep)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))    # FA2 writes +inf for rows with no key
        zero = torch.zeros((), dtype=torch.int64)
        return (out.to(query.dtype), lse.contiguous(), None, None, sq, sk, zero, zero.clone(), None)

    # ------------------------------------------------------------------ efficient
    @staticmethod
    def _check_efficient(name, query, key, value, bias):
        cc = _cc()
        if query.dtype == torch.float64:
            raise RuntimeError(f"{name}: fp64 is not supported")
        if query.dtype == torch.bfloat16 and cc[0] < 8:
            # sdp_utils.cpp can_use_mem_efficient_attention: less_than_sm80_mem_efficient_dtypes = {Half, Float}
            raise RuntimeError("memory efficient attention has no bfloat16 kernels below sm80")
        if not (query.shape[1] == key.shape[1] == value.shape[1]):
            # attention.cu _efficient_attention_forward/_backward: query, key and value share num_heads
            raise RuntimeError("query/key/value must have the same number of heads")
        for t in (query, key, value):
            if t.stride(-1) != 1:
                raise RuntimeError("Input tensor must have contiguous last dimension")
        if bias is None:
            return
        if bias.dtype != query.dtype:
            # attention.cu _efficient_attention_forward
            raise RuntimeError("invalid dtype for bias - should match query's dtype")
        # mem_eff_attention/kernel_forward.h check_supported: bias strides must be multiples of the
        # kernel's alignment (16 bytes for the aligned kernels; the public SDPA pads the bias in
        # attention.cpp preprocess_mask/pad_bias so that they are)
        align = 16 // bias.element_size()
        b, h, sq = bias.shape[0], bias.shape[1], bias.shape[2]
        for dim, size, label in ((0, b, "strideB"), (1, h, "strideH"), (2, sq, "strideM")):
            if size > 1 and bias.stride(dim) % align:
                raise RuntimeError(f"attn_bias is not correctly aligned ({label}). attn_bias.stride({dim}) = "
                                   f"{bias.stride(dim)}, and should be a multiple of {align}.")
        if bias.stride(-1) != 1:
            raise RuntimeError("attn_bias must have contiguous last dimension")

    @staticmethod
    def _scores_keep(query, key, bias, is_causal):
        sq, sk = query.shape[2], key.shape[2]
        keep = None
        if is_causal:                      # attention.cu: CustomMaskType::CausalFromTopLeft
            m, n = positions(sq, sk)
            keep = n <= m
        return keep

    def efficient(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                  scale=None):
        self.calls.append(dict(op="efficient", dtype=query.dtype, head_dim=query.shape[-1], causal=is_causal,
                               bias_dtype=None if attn_bias is None else attn_bias.dtype))
        self._check_efficient("efficient_attention_forward", query, key, value, attn_bias)
        sq = query.shape[2]
        sc = scale if scale is not None else query.shape[-1] ** -0.5
        keep = self._scores_keep(query, key, attn_bias, is_causal)
        out, lse = attend(query, key, value, sc, keep, bias=attn_bias)
        # attention.cu: logsumexp [B, H, ceil_div(Sq, 32) * 32] on CUDA (kAlignLSE = 32); tail is garbage
        pad = (-sq) % 32
        lse = torch.cat([lse, torch.full((*lse.shape[:-1], pad), 1e30)], dim=-1) if pad else lse
        zero = torch.zeros((), dtype=torch.int64)
        return out.to(query.dtype), lse.contiguous(), zero, zero.clone()

    def efficient_backward(self, grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                           philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        self.calls.append(dict(op="efficient_backward", dtype=query.dtype, head_dim=query.shape[-1],
                               causal=is_causal))
        self._check_efficient("efficient_attention_backward", query, key, value, attn_bias)
        sq = query.shape[2]
        if logsumexp.dtype != torch.float32 or logsumexp.shape[-1] < sq:
            raise RuntimeError("logsumexp must be float32 [B, H, >= Sq]")
        lse = logsumexp[..., :sq]
        sc = scale if scale is not None else query.shape[-1] ** -0.5
        keep = self._scores_keep(query, key, attn_bias, is_causal)
        if attn_bias is None:
            dq, dk, dv = attend_grad(query, key, value, grad_out, out, lse, torch.ones_like(lse), sc, keep)
        else:
            qd, kd, vd = (x.detach().float().requires_grad_() for x in (query, key, value))
            s = torch.matmul(qd, kd.transpose(-1, -2)) * sc + attn_bias.float()
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            p = torch.exp(s - lse.float().unsqueeze(-1))
            o = torch.matmul(p, vd)
            # the flash-style backward: D = rowsum(dO * O) from the given out, not the recomputed one
            delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
            ds = p * (torch.matmul(grad_out.float(), vd.detach().transpose(-1, -2)) - delta)
            dq = torch.matmul(ds, kd.detach()) * sc
            dk = torch.matmul(ds.transpose(-1, -2), qd.detach()) * sc
            dv = torch.matmul(p.transpose(-1, -2), grad_out.float())
            del o
        dt = query.dtype
        return dq.to(dt), dk.to(dt), dv.to(dt), torch.empty(0)
