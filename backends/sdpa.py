"""torch SDPA through the aten ops that return a log-sum-exp.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (natural-log lse,
memory order [B, S, H], 0 for fully masked rows: normalised here).  Window, alibi and ring
position offsets are applied through a float mask, so they stay exact across ring blocks.
The CPU op ignores a non-unit stride of the last dim (it reads the head dim as if it were
contiguous), so the inputs are declared ``last-dim-contiguous`` and copied only then.

CUDA/ROCm (the aten ops called directly, without the public SDPA's own preparation):

* ``aten._scaled_dot_product_flash_attention`` (vendored FlashAttention-2) takes fp16/bf16,
  a head dim that is a multiple of 8 and at most 256, compute capability 8.0 or newer, no
  mask, and aligns causal bottom-right.  The public SDPA pads the head dim first
  (``pad_last_dim<8>``); this adapter pads it too, passes the scale of the unpadded head dim
  and slices the output.  It is used only for fp16/bf16 calls without window/alibi, with
  ``Sq == Sk`` when causal, on compute capability >= 8.0 (when known).
* ``aten._scaled_dot_product_efficient_attention`` takes every other call: the window,
  alibi and ring offsets go in as an additive bias, which must be in q's dtype and whose
  strides must be multiples of 16 bytes (the public SDPA pads it in ``preprocess_mask``);
  the bias is built with its last dim padded to a multiple of 16 and sliced, and ALiBi in
  fp16/bf16 runs the whole call in fp32 so the integer distances are not rounded (as on the
  CPU).  Its ``is_causal`` is top-left.  Its lse is padded to a multiple of 32 on CUDA
  (compact on ROCm), and its backward takes the same layout.

The CUDA ops are looked up through :func:`cuda_ops`, which a contract test replaces with CPU
stand-ins that enforce the real ops' checks.
"""
from __future__ import annotations

import torch

from usp_hal.dispatch.backend import (
    AttentionBackend,
    lse_for_backward,
    normalize_lse,
    pad_head_dim,
    pad_to,
    position_mask,
)
from usp_hal.dispatch.capabilities import KernelCall, Limit
from usp_hal.dispatch.platform import compute_capability, device_type_of

_HALF = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIM_MULTIPLE = 8
FLASH_HEAD_DIM_MAX = 256
BIAS_ALIGN_ELEMENTS = 16        # the public SDPA pads the bias' last dim to 8; 16 keeps 16-byte strides for fp32 too
CUDA_LSE_ALIGN = {"cuda": 32, "rocm": 1}


def cuda_ops():
    """``(flash, efficient, efficient_backward)``: the aten ops, looked up at call time."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_efficient_attention_backward)


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
    SUPPORTS_MASK = True         # a boolean mask becomes part of the additive mask / bias
    SUPPORTS_GQA = True
    # Dk != Dv: q/k/v are zero-padded to one head dim (the CPU op requires equal head sizes: "Q/K/V should have
    # the same head size", torch 2.13.0 run here; the CUDA path pads as well rather than rely on either op)
    SUPPORTS_DIFFERENT_V_DIM = True
    RETURNS_LSE = True
    HAS_BACKWARD = True
    IS_DETERMINISTIC = True   # on CPU; the CUDA efficient backward is refused below
    INPUT_LAYOUT = "last-dim-contiguous"
    # PROPAGATES_NAN stays empty (the core guards every device): on torch 2.13.0 the CPU op
    # returns a finite out and lse for a query row holding a NaN when it sees fewer than 16
    # keys in float32/bfloat16 (8 in float64), and carries it with more; tests/test_trust.py
    # checks the guarded result, ci/device_check.py (kernel/sdpa/nonfinite) records the facts
    LIMITS = (
        Limit("fp64 is only supported on cpu (the CUDA attention ops take fp16/bf16/fp32)",
              uses=("fp64",), devices=("cuda", "rocm"),
              source="pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp can_use_mem_efficient_attention"),
        Limit("the CUDA efficient-attention backward is not deterministic", uses=("deterministic",),
              devices=("cuda", "rocm"),
              source="pytorch aten/src/ATen/native/transformers/cuda/attention_backward.cu (atomic dq)"),
        Limit("bf16 on cuda needs compute capability >= 8.0 (found {cc}); the efficient kernel has no "
              "bf16 kernels below sm80: use fp16 or fp32", uses=("bf16",), devices=("cuda",), archs=("sm80+",),
              source="pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp "
                     "less_than_sm80_mem_efficient_dtypes"),
    )
    UPSTREAM_CHECKED = (
        ("CPU op: lse natural log, memory [B, S, H], 0 for masked rows; a non-unit last-dim stride is read "
         "as contiguous", "torch 2.13.0 (run here)"),
        ("flash op: head dim multiple of 8 and <= 256, sm80+, fp16/bf16, bottom-right causal",
         "pytorch aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp mha_fwd/mha_bwd"),
        ("efficient op: bias in q's dtype, bias strides aligned; lse padded to 32 on CUDA",
         "pytorch aten/src/ATen/native/transformers/cuda/attention.cu, mem_eff_attention/kernel_forward.h "
         "check_supported; attention.cpp preprocess_mask"),
    )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _needs_mask(call: KernelCall) -> bool:
        return call.positional or call.mask is not None

    @staticmethod
    def _compute_dtype(q, call: KernelCall):
        # an alibi bias in bf16/fp16 loses integer distances; compute those calls in fp32
        return torch.float32 if (call.alibi_slopes is not None and q.dtype in _HALF) else q.dtype

    @staticmethod
    def _mask(q, k, call: KernelCall, dtype):
        return position_mask(q.shape[1], k.shape[1], causal=call.causal, window=call.window,
                             key_offset=call.key_offset, alibi_slopes=call.alibi_slopes, batch=q.shape[0],
                             heads=q.shape[2], dtype=dtype, device=q.device, keep=call.mask)

    # ------------------------------------------------------------------ forward
    def kernel_forward(self, q, k, v, call: KernelCall):
        dk, dv = q.shape[-1], v.shape[-1]
        if dk != dv:        # Dk != Dv: one common head dim (zero columns change no score and no output column)
            d = max(dk, dv)
            out, lse = self.kernel_forward(pad_to(q, d), pad_to(k, d), pad_to(v, d), call)
            return out[..., :dv], lse
        dev = device_type_of(q.device)
        if dev == "cpu":
            return self._forward_cpu(q, k, v, call)
        return self._forward_cuda(dev, q, k, v, call)

    def _forward_cpu(self, q, k, v, call: KernelCall):
        cdt = self._compute_dtype(q, call)
        if cdt == q.dtype:
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            qt, kt, vt = (x.to(cdt).transpose(1, 2) for x in (q, k, v))
        empty = None
        if self._needs_mask(call):
            mask, empty = self._mask(q, k, call, cdt)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, False, attn_mask=mask, scale=call.scale)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, call.causal, scale=call.scale)
            if lse.dtype in (torch.float32, torch.float64):
                # no mask: no row is empty and the CPU op never writes +inf, so the lse only needs
                # the contract's contiguous [B, H, S] layout (the op's memory is [B, S, H])
                out = out.transpose(1, 2)
                return (out if out.dtype == q.dtype else out.to(q.dtype)), lse.contiguous()
        return out.transpose(1, 2).to(q.dtype), normalize_lse(lse, empty)

    def _bound_forward(self, q, call: KernelCall, want_lse: bool):
        """The CPU call without a mask in float32/float64: the op on transposed views, and the lse
        made contiguous only when the caller keeps it; anything else takes the general path."""
        general = super()._bound_forward(q, call, want_lse)
        if (self._needs_mask(call) or device_type_of(q.device) != "cpu"
                or q.dtype not in (torch.float32, torch.float64)):
            return general
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        scale, causal = call.scale, call.causal

        def run(q, k, v):
            if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or q.shape[-1] != v.shape[-1]:
                return general(q, k, v)
            out, lse = op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
            return out.transpose(1, 2), (lse.contiguous() if want_lse else lse)
        return run

    def _use_flash(self, dev, q, k, call: KernelCall) -> bool:
        if q.dtype not in _HALF or self._needs_mask(call) or dev != "cuda":
            return False
        if call.causal and q.shape[1] != k.shape[1]:
            return False        # the flash op aligns causal bottom-right
        if q.shape[-1] > FLASH_HEAD_DIM_MAX:
            return False
        cc = compute_capability(dev, q.device.index or 0)
        return cc is None or tuple(cc) >= (8, 0)

    def _forward_cuda(self, dev, q, k, v, call: KernelCall):
        flash, efficient, _ = cuda_ops()
        d, sq, h = q.shape[-1], q.shape[1], q.shape[2]
        if self._use_flash(dev, q, k, call):
            qt, kt, vt = (pad_head_dim(x, FLASH_HEAD_DIM_MULTIPLE).transpose(1, 2) for x in (q, k, v))
            res = flash(qt, kt, vt, 0.0, bool(call.causal), False, scale=call.scale)
            return res[0].transpose(1, 2)[..., :d], normalize_lse(normalize_cuda_lse(res[1], sq))
        cdt = self._compute_dtype(q, call)
        qt, kt, vt = (pad_head_dim(x.to(cdt), FLASH_HEAD_DIM_MULTIPLE).transpose(1, 2) for x in (q, k, v))
        kt, vt = _repeat_kv(kt, h), _repeat_kv(vt, h)
        bias, empty = self._bias(q, k, call, cdt)
        res = efficient(qt, kt, vt, bias, True, 0.0, bool(call.causal) and bias is None, scale=call.scale)
        out = res[0].transpose(1, 2)[..., :d].to(q.dtype)
        if empty is not None:     # rows that see no key: out 0 whatever the kernel left there
            out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0)
        return out, normalize_lse(normalize_cuda_lse(res[1], sq), empty)

    def _bias(self, q, k, call: KernelCall, dtype):
        """The additive bias [B, H, Sq, Sk] for window/alibi/mask (causal folded in), or (None, None).
        Built with its last dim padded to a multiple of 16 elements, then sliced, so every
        stride the kernel checks is aligned."""
        if not self._needs_mask(call):
            return None, None
        b, sq, h = q.shape[0], q.shape[1], q.shape[2]
        sk = k.shape[1]
        mask, empty = self._mask(q, k, call, dtype)
        padded = -(-sk // BIAS_ALIGN_ELEMENTS) * BIAS_ALIGN_ELEMENTS
        bias = torch.empty(*mask.shape[:-1], padded, dtype=dtype, device=q.device)[..., :sk]
        bias.copy_(mask)
        return bias.expand(b, h, sq, sk), empty      # broadcast dims have stride 0: aligned

    # ------------------------------------------------------------------ backward
    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        dk_, dv_ = q.shape[-1], v.shape[-1]
        if dk_ != dv_:      # Dk != Dv: the forward's common head dim; the zero columns get gradients that are dropped
            d = max(dk_, dv_)
            dq, dk, dv = self.kernel_backward(pad_to(dout, d), pad_to(q, d), pad_to(k, d), pad_to(v, d),
                                              pad_to(out, d), lse, call)
            return dq[..., :dk_], dk[..., :dk_], dv[..., :dv_]
        lse = lse_for_backward(lse)
        dev = device_type_of(q.device)
        if dev == "cpu":
            cdt = self._compute_dtype(q, call)
            qt, kt, vt, ot, dot = (x.to(cdt).transpose(1, 2) for x in (q, k, v, out, dout))
            kw = {"scale": call.scale}
            causal = call.causal
            if self._needs_mask(call):
                kw["attn_mask"] = self._mask(q, k, call, cdt)[0]
                causal = False
            lse = lse.to(torch.float64 if cdt == torch.float64 else torch.float32)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, causal, **kw)
            return tuple(g.transpose(1, 2).to(q.dtype) for g in (dq, dk, dv))
        return self._backward_cuda(dev, (dout, q, k, v, out, lse), call)

    def _backward_cuda(self, dev, tensors, call: KernelCall):
        _, _, efficient_backward = cuda_ops()
        dout, q, k, v, out, lse = tensors
        d, h, hkv = q.shape[-1], q.shape[2], k.shape[2]
        cdt = self._compute_dtype(q, call)
        qt, ot, dot = (pad_head_dim(x.to(cdt), FLASH_HEAD_DIM_MULTIPLE).transpose(1, 2) for x in (q, out, dout))
        kt, vt = (_repeat_kv(pad_head_dim(x.to(cdt), FLASH_HEAD_DIM_MULTIPLE).transpose(1, 2), h) for x in (k, v))
        bias, _ = self._bias(q, k, call, cdt)
        align = CUDA_LSE_ALIGN.get(dev, 32)
        pad = (-lse.shape[-1]) % align
        lse_p = torch.nn.functional.pad(lse.float(), (0, pad)) if pad else lse.float().contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = efficient_backward(dot, qt, kt, vt, bias, ot, lse_p, seed, seed, 0.0,
                                           [True, True, True, False], bool(call.causal) and bias is None,
                                           scale=call.scale)
        dk, dv = _sum_kv(dk, hkv), _sum_kv(dv, hkv)
        return tuple(g.transpose(1, 2)[..., :d].to(q.dtype) for g in (dq, dk, dv))


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, H, S, D] for kernels without native GQA."""
    hkv = x.shape[1]
    return x if hkv == heads else x.repeat_interleave(heads // hkv, dim=1)


def _sum_kv(g: torch.Tensor, hkv: int) -> torch.Tensor:
    b, h, s, d = g.shape
    return g if h == hkv else g.reshape(b, hkv, h // hkv, s, d).sum(2)
