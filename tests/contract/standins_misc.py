"""Stand-ins for the SageAttention, FlashInfer, Ascend NPU and Intel XPU contract tests.

Each stand-in keeps the real package's import path, signature and behaviour, read from the
real sources (each quirk carries its source at the line that models it), and computes
plain float32 attention on CPU tensors in the *kernel's* own conventions (its layout, lse
base and shape, causal/window alignment, masked-row values, output arity), so an adapter
that maps an argument wrongly fails against the float64 reference.  The device the
stand-in runs on is the one :func:`usp_hal.dispatch.platform.emulate` reports:

* ``sageattention`` 1.0.6 (the wheel): ``sageattn`` without ``return_lse``; head dims
  64/96/128 only; causal only for equal lengths; ``k -= km`` in place on the caller's k;
  non-causal calls count the zero padding of the last block of 64 keys as keys (what the
  real kernel does under the Triton interpreter).
* ``sageattention`` 2.x (thu-ml/SageAttention v2.0.1, 2.1.1, v2.2.0, main): architecture
  dispatch per version; ``return_lse``; lse ``[B, H, Sq]`` natural log; the smoothing
  correction's GQA errors of the releases before 2.2.0 (and of 2.2.0's sm86 path); before
  2.2.0 the sm86 (Triton) path's non-causal padding keys, as in 1.0.6.
* ``flashinfer`` (flashinfer-ai/flashinfer v0.6.18): ``single_prefill_with_kv_cache`` on
  ``[S, H, D]`` (no batch dim), lse base 2 ``[S, H]``, causal and ``window_left`` aligned
  bottom-right, kernels for head dims 64/128/256 here; optionally ``flashinfer_jit_cache``.
* ``torch_npu`` (Ascend/op-plugin docs and op_plugin_functions.yaml): ``npu_fusion_attention``
  / ``npu_fusion_attention_grad`` with ``softmax_max/softmax_sum`` ``[B, N, S, 8]``,
  ``sparse_mode`` semantics (2/3 need the compressed 2048x2048 mask; no mask means full
  attention whatever the mode), the misspelled ``pre_tockens/next_tockens``, ``scale`` vs
  ``scale_value``, and a grad op whose output count depends on the release.
* XPU (intel/torch-xpu-ops release/2.10-2.14 sycltla/mha_fwd.cpp, mha_bwd.cpp): CPU
  functions with the signatures of ``aten._scaled_dot_product_flash_attention`` and its
  backward: head dims and device models per torch version, BSHD/BHSD layouts only,
  bottom-right causal, lse 0 for fully masked rows, undefined ``cum_seq``; substituted
  through ``usp_hal.backends.xpu.flash_ops``.

Every stand-in records its calls in a module-level ``CALLS`` list so a test can check
what reached the kernel.  The lower half of this file holds small helpers the four test
modules share (inputs, float64 reference gradients, comparisons).
"""
from __future__ import annotations

import inspect
import sys

import torch

from usp_hal.dispatch.reference import TOLERANCES, reference_attention

from .standin import install_standin, purge_modules  # noqa: F401  (re-exported for the tests)


# ----------------------------------------------------------------------------- stand-in math
def attend(q, k, v, scale, keep=None, softcap=0.0, bias=None):
    """q [B, H, Sq, D], k/v [B, Hkv, Sk, D] -> (out, lse) float32, lse natural log.

    ``keep`` (bool, broadcastable to [B, H, Sq, Sk]) marks visible keys; a row with none
    gives out 0 and lse -inf.  ``bias`` (broadcastable to the scores) is added after scaling."""
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"stand-in: {h} query heads is not a multiple of {hkv} kv heads")
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf.repeat_interleave(h // hkv, dim=1)
    vf = vf.repeat_interleave(h // hkv, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    return torch.matmul(p, vf), lse


def attend_grad(q, k, v, dout, out, row_max, row_sum, scale, keep=None):
    """Flash-style backward from saved row statistics: P = exp(s - row_max) / row_sum.

    All of q/dout/out are [B, H, Sq, D], k/v [B, Hkv, Sk, D], row_max/row_sum [B, H, Sq].
    Returns float32 (dq, dk, dv) with dk/dv summed back to Hkv heads."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = h // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    dof, of = dout.float(), out.float()
    kr = kf.repeat_interleave(group, dim=1)
    vr = vf.repeat_interleave(group, dim=1)
    s = torch.matmul(qf, kr.transpose(-1, -2)) * scale
    p = torch.exp(s - row_max.float().unsqueeze(-1)) / row_sum.float().unsqueeze(-1)
    if keep is not None:
        p = p.masked_fill(~keep, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vr.transpose(-1, -2))
    delta = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dk = dk.view(b, hkv, group, sk, d).sum(2)
    dv = dv.view(b, hkv, group, sk, dv.shape[-1]).sum(2)
    return dq, dk, dv


def _pad_keys(k, v, block):
    """k/v [B, Hkv, Sk, D] zero-padded along the keys to a multiple of ``block``."""
    pad = (-k.shape[2]) % block
    return tuple(torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (k, v))


def positions(sq, sk, device=None):
    """(m, n): query positions as a column, key positions as a row."""
    return (torch.arange(sq, device=device).unsqueeze(1), torch.arange(sk, device=device).unsqueeze(0))


MATH_SOURCE = "import math\nimport torch\n\n\n" + "\n\n".join(
    inspect.getsource(f) for f in (attend, attend_grad, _pad_keys, positions))


# ----------------------------------------------------------------------------- sageattention
SAGE_V1 = """
import torch
from ._standin_math import _pad_keys, attend, positions

CALLS = []


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, **kwargs):
    # sageattention 1.0.6 wheel, sageattention/core.py sageattn: returns only o (no return_lse)
    CALLS.append(dict(tensor_layout=tensor_layout, is_causal=is_causal, sm_scale=sm_scale,
                      head_dim=q.size(-1), k_ptr=k.data_ptr()))
    dtype = q.dtype
    # core.py sageattn: fp16, bf16 and fp32 are accepted (v is converted to fp16)
    assert dtype in [torch.float16, torch.bfloat16, torch.float32], \\
        "Input tensors must be in dtype of torch.float16, torch.bfloat16, or torch.float32."
    assert q.dtype == k.dtype == v.dtype, "All tensors must have the same dtype."
    headdim = q.size(-1)
    # core.py sageattn: assert headdim in [64, 96, 128]
    assert headdim in [64, 96, 128], "headdim should be in [64, 96, 128]."
    # core.py sageattn: assert last dim is contiguous
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Last dim of qkv must be contiguous."
    seq_dim = 1 if tensor_layout == "NHD" else 2
    if smooth_k:
        # core.py sageattn: km = k.mean(dim=seq_dim, keepdim=True); k -= km  (in place, on the caller's k)
        km = k.mean(dim=seq_dim, keepdim=True)
        k -= km
    if tensor_layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    elif tensor_layout != "HND":
        raise ValueError(f"Unknown tensor layout: {tensor_layout}")
    sq, sk = q.shape[2], k.shape[2]
    keep = None
    if is_causal:
        # attn_qk_int8_per_block_causal.py forward: assert qo_len == kv_len
        assert sq == sk, "qo_len and kv_len must be equal for causal attention"
        m, n = positions(sq, sk)
        keep = n <= m
    # quant_per_block.py per_block_int8: sm_scale defaults to head_dim ** -0.5 of the given tensors
    scale = sm_scale if sm_scale is not None else headdim ** -0.5
    # subtracting K's mean along the sequence changes every score of a row by the same amount:
    # the softmax, and so the output, is the same as without smoothing
    if not is_causal and sk % 64:
        # attn_qk_int8_per_block.py _attn_fwd_inner: the last block of BLOCK_N=64 keys is loaded with a
        # mask (zeros past kv_len) and its scores are never masked, so the padding counts as keys with
        # score 0 (in the smoothed frame) and value 0 (seen with the real kernel under TRITON_INTERPRET=1)
        k, v = _pad_keys(k, v, 64)
    out, _ = attend(q, k, v, scale, keep)
    out = out.to(dtype)
    return out.transpose(1, 2) if tensor_layout == "NHD" else out
"""

SAGE_V2 = """
import torch
from ._standin_math import _pad_keys, attend, positions
from packaging.version import Version

CALLS = []
VERSION = "{version}"


def _arch():
    from usp_hal.dispatch import platform
    em = platform.emulated()
    if em is None or em.device_type != "cuda":
        raise AssertionError("Input tensors must be on cuda.")
    return "sm%d%d" % em.compute_capability


def _dispatches():
    # thu-ml/SageAttention sageattention/core.py sageattn: v2.0.1 sm80/86/89/90; sm120 from 2.1.1
    # (4b0824d); sm121 only after the v2.2.0 tag (still "2.2.0")
    archs = ["sm80", "sm86", "sm89", "sm90"]
    if Version(VERSION) >= Version("2.1.1"):
        archs.append("sm120")
    if Version(VERSION) > Version("2.2.0"):
        archs.append("sm121")
    return archs


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
    CALLS.append(dict(tensor_layout=tensor_layout, is_causal=is_causal, sm_scale=sm_scale,
                      return_lse=return_lse, head_dim=q.size(-1), kwargs=dict(kwargs),
                      heads=(q.size(2), k.size(2)) if tensor_layout == "NHD" else (q.size(1), k.size(1))))
    arch = _arch()
    if arch not in _dispatches():
        raise ValueError(f"Unsupported CUDA architecture: {arch}")
    # core.py sageattn_qk_int8_pv_*: fp16/bf16 only
    assert q.dtype in [torch.float16, torch.bfloat16], \
        "Input tensors must be in dtype of torch.float16 or torch.bfloat16"
    headdim = q.size(-1)
    # core.py: head dims < 64 padded to 64, (64, 128) padded to 128, > 128 rejected
    if headdim > 128:
        raise ValueError(f"Unsupported head_dim: {headdim}")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Last dim of qkv must be contiguous."
    if tensor_layout == "NHD":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    elif tensor_layout != "HND":
        raise ValueError(f"tensor_layout {tensor_layout} not supported")
    h, hkv = q.shape[1], k.shape[1]
    if return_lse and h != hkv:
        # core.py lse_correction = q @ km: before v2.2.0 km is not repeated for GQA (9cd0915 "fix gqa
        # case"), a shape error for 1 < Hkv < H; in v2.2.0 the sm86 (Triton) path repeats km along
        # the sequence axis for NHD (nh_dim = 2 if tensor_layout == 0 else 1), also a shape error
        if (Version(VERSION) < Version("2.2.0") and hkv > 1) or (
                Version(VERSION) == Version("2.2.0") and arch == "sm86" and tensor_layout == "NHD"):
            raise RuntimeError("The size of tensor a must match the size of tensor b at non-singleton dimension 1")
    sq, sk = q.shape[2], k.shape[2]
    keep = None
    if is_causal:
        if sq != sk:
            raise ValueError("stand-in: is_causal is only defined for qo_len == kv_len")
        m, n = positions(sq, sk)
        keep = n <= m
    scale = sm_scale if sm_scale is not None else headdim ** -0.5
    if not is_causal and sk % 64 and arch == "sm86" and Version(VERSION) < Version("2.2.0"):
        # sm86 runs sageattention/triton/attn_qk_int8_per_block.py: until 499828b (2025-08-04, in the
        # v2.2.0 tag) its scores are not masked either, so the zero padding of the last block of 64
        # smoothed keys counts as keys (score 0, value 0), in the output and in the lse; the lse is then
        # corrected for the smoothing by q.km (core.py sageattn_qk_int8_pv_fp16_triton)
        km = k.float().mean(dim=2, keepdim=True)
        kp, vp = _pad_keys(k.float() - km, v, 64)
        out, lse = attend(q, kp, vp, scale, keep)
        lse = lse + scale * torch.matmul(q.float(), km.repeat_interleave(h // hkv, dim=1).transpose(-1, -2))[..., 0]
    else:
        out, lse = attend(q, k, v, scale, keep)
    out = out.to(q.dtype)
    if tensor_layout == "NHD":
        out = out.transpose(1, 2)
    # core.py: the kernel's base-2 lse is returned as lse / log2(e) + smoothing correction: natural log
    return (out, lse.float()) if return_lse else out
"""


def sage_files(version: str) -> dict:
    body = SAGE_V1 if int(version.split(".")[0]) < 2 else SAGE_V2.replace("{version}", version)
    return {
        "sageattention/__init__.py": "from .core import CALLS, sageattn\n",
        "sageattention/core.py": body,
        "sageattention/_standin_math.py": MATH_SOURCE,
    }


# ----------------------------------------------------------------------------- flashinfer
FLASHINFER_PREFILL = '''
import functools
import math

import torch
from ._standin_math import attend, positions

CALLS = []


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None,
                                 custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 backend="auto", return_lse=False, kv_cache_sf=None, k_scale=None, v_scale=None):
    """One request: q [qo_len, H, D], k/v [kv_len, Hkv, D] (NHD) -> out [qo_len, H, D],
    lse [qo_len, H] float32 in BASE 2.  Causal and window_left are aligned bottom-right.
    flashinfer v0.6.18 flashinfer/prefill.py single_prefill_with_kv_cache (signature);
    include/flashinfer/attention/prefill.cuh (lse = log2(d) + m, base 2; mask positions
    relative to kv_len - qo_len)."""
    CALLS.append(dict(shape=tuple(q.shape), causal=causal, kv_layout=kv_layout, sm_scale=sm_scale,
                      window_left=window_left, logits_soft_cap=logits_soft_cap, return_lse=return_lse))
    if q.dim() != 3:
        raise ValueError(f"q must be [qo_len, num_qo_heads, head_dim], got {tuple(q.shape)} (no batch dim)")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"stand-in: unsupported dtype {q.dtype}")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    elif kv_layout != "NHD":
        raise KeyError(kv_layout)
    head_dim = q.shape[-1]
    if head_dim not in (64, 128, 256):
        raise RuntimeError(f"Unsupported head dim: {head_dim}")
    qo_len, kv_len = q.shape[0], k.shape[0]
    m, n = positions(qo_len, kv_len)
    shift = kv_len - qo_len
    keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if causal:
        keep &= n <= m + shift
    if window_left >= 0:
        keep &= n + window_left >= m + shift
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out, lse = attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                      v.transpose(0, 1).unsqueeze(0), scale, keep, softcap=logits_soft_cap or 0.0)
    out = out[0].transpose(0, 1).to(o_dtype or q.dtype)
    lse2 = (lse[0].transpose(0, 1) / math.log(2.0)).contiguous()
    return (out, lse2) if return_lse else out


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
'''


def flashinfer_files(jit_cache: bool = True) -> dict:
    """``jit_cache`` also installs a ``flashinfer_jit_cache`` module: the prebuilt kernels that
    spare FlashInfer's JIT a CUDA compiler (flashinfer v0.6.18 flashinfer/jit/env.py
    has_flashinfer_jit_cache)."""
    files = {
        "flashinfer/__init__.py": ("from .prefill import (CALLS, single_prefill_with_kv_cache,\n"
                                   "                      single_prefill_with_kv_cache_return_lse)\n"),
        "flashinfer/prefill.py": FLASHINFER_PREFILL,
        "flashinfer/_standin_math.py": MATH_SOURCE,
    }
    if jit_cache:
        files["flashinfer_jit_cache/__init__.py"] = "__version__ = '0.0.0'\n"
    return files


# ----------------------------------------------------------------------------- torch_npu
NPU_COMMON = '''
import torch
from ._standin_math import attend, attend_grad, positions

CALLS = []
COMPRESSED = 2048


def _keep(sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens):
    """Visible keys for a BSND call, following the documented sparse_mode rules
    (Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md: atten_mask None ignores
    sparse_mode/pre/next; modes 2/3 take the compressed 2048x2048 upper-triangular mask,
    2 = leftUpCausal, 3 = rightDownCausal)."""
    if atten_mask is None:
        return None                      # no mask: sparse_mode and pre/next are ignored
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError("atten_mask must be bool or uint8 (1/True = masked out)")
    m, n = positions(sq, sk)
    if sparse_mode in (2, 3):
        expected = torch.triu(torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool), diagonal=1)
        if tuple(atten_mask.shape) != (COMPRESSED, COMPRESSED) or not torch.equal(atten_mask.bool().cpu(), expected):
            raise ValueError("sparse_mode 2/3 need the compressed 2048x2048 upper-triangular atten_mask")
        return n <= m if sparse_mode == 2 else n <= m + (sk - sq)
    if sparse_mode in (0, 1):
        keep = ~atten_mask.bool().reshape(-1, sq, sk)[0]
        if sparse_mode == 0:
            keep = keep & (m - n <= pre_tockens) & (n - m <= next_tockens)
        return keep
    raise NotImplementedError(f"stand-in does not model sparse_mode={sparse_mode}")


def _check(query, key, value, head_num, input_layout, keep_prob):
    # docs/context/torch_npu-npu_fusion_attention.md: D in 1..768 with Dq == Dk >= Dv; Nq in 1..256
    if not 1 <= query.shape[-1] <= 768 or query.shape[-1] != key.shape[-1] or value.shape[-1] > key.shape[-1]:
        raise ValueError(f"head dim {query.shape[-1]} outside 1..768 (Dq == Dk >= Dv)")
    if not 1 <= query.shape[2] <= 256:
        raise ValueError(f"Nq={query.shape[2]} outside 1..256")
    if input_layout != "BSND":
        raise NotImplementedError(f"stand-in models input_layout='BSND' only, got {input_layout!r}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("BSND inputs must be 4-D")
    if head_num != query.shape[2]:
        raise ValueError(f"head_num={head_num} but query has {query.shape[2]} heads")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported dtype {query.dtype}")
    if keep_prob != 1.0:
        raise NotImplementedError("stand-in does not model dropout")


def npu_fusion_attention(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                         atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                         softmax_layout=""):
    CALLS.append(dict(op="fwd", scale=scale, sparse_mode=sparse_mode,
                      mask_shape=None if atten_mask is None else tuple(atten_mask.shape)))
    _check(query, key, value, head_num, input_layout, keep_prob)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    keep = _keep(q.shape[2], k.shape[2], atten_mask, sparse_mode, pre_tockens, next_tockens)
    out, lse = attend(q, k, v, scale, keep)
    qf, kf = q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    row_max = s.amax(-1)
    row_sum = torch.exp(lse - row_max)     # sum of exp(s - max)
    smax = row_max.unsqueeze(-1).expand(*row_max.shape, 8).contiguous()
    ssum = row_sum.unsqueeze(-1).expand(*row_sum.shape, 8).contiguous()
    return (out.to(query.dtype).transpose(1, 2).contiguous(), smax, ssum,
            torch.empty(0, dtype=query.dtype), 0, 0, 0)


def _grad(query, key, value, dy, head_num, input_layout, atten_mask, softmax_max, softmax_sum,
          attention_in, scale_value, keep_prob, pre_tockens, next_tockens, sparse_mode):
    CALLS.append(dict(op="grad", scale_value=scale_value, sparse_mode=sparse_mode,
                      mask_shape=None if atten_mask is None else tuple(atten_mask.shape)))
    _check(query, key, value, head_num, input_layout, keep_prob)
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise ValueError("npu_fusion_attention_grad needs softmax_max, softmax_sum and attention_in")
    b, s1, n = query.shape[0], query.shape[1], query.shape[2]
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if tuple(t.shape) != (b, n, s1, 8) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [B, N, S1, 8], got {t.dtype} {tuple(t.shape)}")
    q, k, v, do, o = (x.transpose(1, 2) for x in (query, key, value, dy, attention_in))
    keep = _keep(q.shape[2], k.shape[2], atten_mask, sparse_mode, pre_tockens, next_tockens)
    dq, dk, dv = attend_grad(q, k, v, do, o, softmax_max[..., 0], softmax_sum[..., 0], scale_value, keep)
    return tuple(g.to(query.dtype).transpose(1, 2).contiguous() for g in (dq, dk, dv))
'''

NPU_GRAD_OLD = '''

def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0,
                              prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                              gen_mask_parallel=True, sync=False):
    """Older releases: (dq, dk, dv, dpse)."""
    dq, dk, dv = _grad(query, key, value, dy, head_num, input_layout, atten_mask, softmax_max, softmax_sum,
                       attention_in, scale_value, keep_prob, pre_tockens, next_tockens, sparse_mode)
    return dq, dk, dv, torch.empty(0, dtype=query.dtype)
'''

NPU_GRAD_NEW = '''

def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0,
                              prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                              gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    """Current releases: (dq, dk, dv, dpse, dsink)."""
    dq, dk, dv = _grad(query, key, value, dy, head_num, input_layout, atten_mask, softmax_max, softmax_sum,
                       attention_in, scale_value, keep_prob, pre_tockens, next_tockens, sparse_mode)
    empty = torch.empty(0, dtype=query.dtype)
    return dq, dk, dv, empty, empty
'''


def npu_files(grad_outputs: int) -> dict:
    """torch_npu stand-in whose grad op returns 4 (older) or 5 (current) items."""
    if grad_outputs not in (4, 5):
        raise ValueError("grad_outputs must be 4 or 5")
    body = NPU_COMMON + (NPU_GRAD_OLD if grad_outputs == 4 else NPU_GRAD_NEW)
    return {
        "torch_npu/__init__.py": ("from .ops import CALLS, npu_fusion_attention, npu_fusion_attention_grad\n"),
        "torch_npu/ops.py": body,
        "torch_npu/_standin_math.py": MATH_SOURCE,
    }


# ----------------------------------------------------------------------------- XPU aten ops
class XPUFlashStandin:
    """CPU functions with the signatures of the XPU aten flash ops, following
    intel/torch-xpu-ops src/ATen/native/transformers/xpu/flash_attn/sycltla/ (mha_fwd.cpp,
    mha_bwd.cpp) of the torch version and device model that ``usp_hal.dispatch.platform.emulate``
    reports."""

    def __init__(self, sum_gqa_grads: bool = True) -> None:
        self.calls: list = []
        # False models a release whose backward hands back dk/dv per query head
        self.sum_gqa_grads = sum_gqa_grads

    @staticmethod
    def _env():
        from packaging.version import Version

        from usp_hal.dispatch import platform
        em = platform.emulated()
        if em is None or em.device_type != "xpu":
            raise RuntimeError("stand-in XPU op called outside platform.emulate('xpu')")
        return Version(Version(platform.torch_version()).public), em.device_model

    @classmethod
    def _check_arch(cls, name):
        from packaging.version import Version
        version, model = cls._env()
        # release/2.10-2.11 mha_fwd.cpp/mha_bwd.cpp: pvc, pvc_vg, bmg_g21; release/2.12+: + bmg_g31
        archs = ["intel_gpu_pvc", "intel_gpu_pvc_vg", "intel_gpu_bmg_g21"]
        if version >= Version("2.12"):
            archs.append("intel_gpu_bmg_g31")
        if model not in archs:
            raise RuntimeError(f"XPU device architecture does not support flash attention{name}. Supported "
                               f"architectures are: {', '.join(archs)}.")
        return version

    @staticmethod
    def _check(name, *tensors):
        dtype = tensors[0].dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"{name} only support fp16 and bf16 data type")
        for t in tensors:
            if t.dim() != 4 or t.dtype != dtype:
                raise RuntimeError(f"{name}: 4-D inputs of one dtype expected")
            if t.stride(-1) != 1:
                raise RuntimeError(f"{name}: input tensor must have contiguous last dimension")
            # mha_fwd.cpp get_attn_tensor_layout: only BHSD or BSHD memory layouts
            if not (t.is_contiguous() or t.transpose(1, 2).is_contiguous()):
                raise RuntimeError(f"{name}: only support BHSD or BSHD layout, got stride {t.stride()}")

    @staticmethod
    def _keep(sq, sk, is_causal):
        if not is_causal:
            return None
        m, n = positions(sq, sk)
        return n <= m + (sk - sq)          # lower-right (bottom-right) causal

    def forward(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                scale=None):
        self.calls.append(dict(op="fwd", is_causal=is_causal, scale=scale, head_dim=query.shape[-1],
                               heads=(query.shape[1], key.shape[1])))
        from packaging.version import Version
        version = self._check_arch("")
        self._check("FlashAttentionForwardXPU", query, key, value)
        if dropout_p != 0.0:
            raise RuntimeError("FlashAttentionForwardXPU does not only support dropout > 0.0 yet")
        d = query.shape[-1]
        if version < Version("2.13"):
            # release/2.10-2.12 sycltla/mha_fwd.cpp run_mha_fwd: kernels for 64, 96, 128, 192 only
            if d not in (64, 96, 128, 192):
                raise RuntimeError("FlashAttentionForwardXPU only support headdim 64,96,128,192")
        elif d > 256 or d != value.shape[-1]:
            # release/2.13+ mha_fwd.cpp: rounds up to 32/64/96/128/192/256, rejects > 256 and Dqk != Dv
            raise RuntimeError(f"FlashAttentionForwardXPU only support headdim up to 256, got {d}")
        sq, sk = query.shape[2], key.shape[2]
        sc = scale if scale is not None else query.shape[-1] ** -0.5
        keep = self._keep(sq, sk, is_causal)
        out, lse = attend(query, key, value, sc, keep)
        lse = lse.masked_fill(torch.isinf(lse), 0.0)     # fully masked rows: lse stored as 0
        zero = torch.zeros((), dtype=torch.int64)
        return (out.to(query.dtype), lse.contiguous(), None, None, sq, sk, zero, zero.clone(), None)

    def backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        self.calls.append(dict(op="bwd", is_causal=is_causal, scale=scale, head_dim=query.shape[-1],
                               heads=(query.shape[1], key.shape[1])))
        from packaging.version import Version
        version = self._check_arch(" backward")
        self._check("FlashAttentionBackwardXPU", grad_out, query, key, value, out)
        if cum_seq_q is not None or cum_seq_k is not None:
            raise RuntimeError("varlen (nested tensor) backward is not supported on XPU; cum_seq must be undefined")
        if dropout_p != 0.0:
            raise RuntimeError("FlashAttentionBackwardXPU does not support dropout > 0.0 yet")
        d = query.shape[-1]
        # release/2.10-2.12 sycltla/mha_bwd.cpp: head dims 64, 96, 128, 192, 256; release/2.13+: up to 256
        if (version < Version("2.13") and d not in (64, 96, 128, 192, 256)) or d > 256:
            raise RuntimeError(f"FlashAttentionBackwardXPU: unsupported head dimension: {d}")
        b, h, sq, _ = query.shape
        if (logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (b, h, sq)
                or not logsumexp.is_contiguous()):
            raise RuntimeError("FlashAttentionBackwardXPU: logsumexp must be contiguous float32 [B, H, Sq]")
        if (max_q, max_k) != (sq, key.shape[2]):
            raise RuntimeError("max_q/max_k do not match the inputs")
        for t in (philox_seed, philox_offset):
            if not isinstance(t, torch.Tensor):
                raise RuntimeError("philox_seed/philox_offset must be tensors")
        sc = scale if scale is not None else query.shape[-1] ** -0.5
        keep = self._keep(sq, key.shape[2], is_causal)
        dq, dk, dv = attend_grad(query, key, value, grad_out, out, logsumexp, torch.ones_like(logsumexp), sc, keep)
        if not self.sum_gqa_grads:
            group = query.shape[1] // key.shape[1]
            dk, dv = (g.repeat_interleave(group, dim=1) / group for g in (dk, dv))
        return tuple(g.to(query.dtype) for g in (dq, dk, dv))


# ----------------------------------------------------------------------------- test helpers
def install(tmp_path, monkeypatch, dist: str, version: str, files: dict):
    """Install a stand-in (see ``standin.install_standin``); returns its site directory.
    The caller's fixture purges the stand-in's modules when the test ends."""
    return install_standin(tmp_path, monkeypatch, dist=dist, version=version, files=files)


def make_inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    from tests.dist_cases import kernel_inputs
    return kernel_inputs(b, sq, sk, h, hkv, d, dtype, seed)


def reference(q, k, v, **kw):
    """float64 (out, lse) of the contract semantics."""
    return reference_attention(q, k, v, **kw)


def reference_grads(q, k, v, dout, **kw):
    """float64 (dq, dk, dv) by autograd through the float64 reference."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, _ = reference_attention(q64, k64, v64, **kw)
    out.backward(dout.double())
    return q64.grad, k64.grad, v64.grad


def assert_matches(actual, expected, dtype, what=""):
    """Compare a kernel result with the float64 reference at the tolerance of ``dtype``."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_lse_matches(lse, expected, what="lse"):
    """lse is float32 in the contract (float64 only for float64 inputs): compare at fp32 tolerance."""
    assert lse.dtype == torch.float32, f"{what}: dtype {lse.dtype}, expected float32"
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(lse.double(), expected.double(), atol=max(atol, 1e-4), rtol=max(rtol, 1e-4),
                               msg=lambda m: f"{what}: {m}")


def merge_blocks(outs, lses):
    """Combine per-key-block (out [B,S,H,D], lse [B,H,S]) results into the full attention (float64)."""
    lse = torch.logsumexp(torch.stack([x.double() for x in lses]), dim=0)
    out = 0
    for o, l in zip(outs, lses):
        w = torch.exp(l.double() - lse).masked_fill(torch.isinf(lse), 0.0)
        out = out + o.double() * w.transpose(1, 2).unsqueeze(-1)
    return out, lse


IMPORT_PROBE = '''
import sys
import torch
import usp_hal
from usp_hal import AttnRequest, get_backend
import usp_hal.backends.{module}
cls = get_backend("{name}")
cls.availability()
cls.capabilities()
cls.not_supported_reasons(AttnRequest(device_type="{device}", dtype=torch.float16, needs_lse=True))
bad = [m for m in sys.modules if m.split(".")[0] == "{kernel}"]
assert not bad, f"kernel package imported: {{bad}}"
print("clean")
'''


def assert_import_is_clean(site, *, module, name, device, kernel):
    """In a fresh interpreter with the stand-in on the path, importing the backend module,
    probing availability and asking for reasons must not import the kernel package."""
    import os
    import subprocess
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    code = IMPORT_PROBE.format(module=module, name=name, device=device, kernel=kernel)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr

