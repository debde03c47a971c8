"""A stand-in for flash-attn-4 4.0.0b36 (``flash_attn.cute``) and a rank function for the
multi-rank case.

The stand-in package has the real import path (``flash_attn/cute/interface.py``), the real
distribution metadata and the real signatures of ``_flash_attn_fwd``/``_flash_attn_bwd``;
it enforces the argument checks the adapter relies on and computes attention in float64 on
CPU tensors, with FA4's layouts and conventions.  Each modelled behaviour cites where it was
read: flash-attn-4 4.0.0b36 wheel (= Dao-AILab/flash-attention flash_attn/cute/), file and
function.  It proves the adapter, not the kernel.

One deviation: the stand-in writes an empty ``flash_attn/__init__.py`` (the wheel has none,
``flash_attn`` being a namespace directory) so that it shadows an installed flash-attn 2,
whose regular package would otherwise win over a namespace portion.
"""
from __future__ import annotations

DIST = "flash-attn-4"
VERSION = "4.0.0b36"
TOP_LEVEL = ("flash_attn",)

INTERFACE = r'''
"""Stand-in for flash_attn/cute/interface.py of flash-attn-4 4.0.0b36 (CPU, float64 math)."""
import math
from typing import Optional

import torch

from usp_hal.dispatch import platform as _platform

FWD_CALLS = []
BWD_CALLS = []


def _get_device_arch():
    # interface.py _get_device_arch: FLASH_ATTENTION_ARCH, else torch.cuda.get_device_capability()
    # (here: the emulated device's compute capability)
    em = _platform.emulated()
    if em is None or em.compute_capability is None:
        raise RuntimeError("stand-in: no emulated CUDA device")
    major, minor = em.compute_capability
    return major * 10 + int(minor)


def _on_cuda(t):
    return t is None or _platform.device_type_of(t.device) == "cuda"


def _validate_head_dims(head_dim, head_dim_v, compute_capability, alignment):
    # interface.py _validate_head_dims (asserts; no check for arch 8 and 12)
    is_deepseek_shape = head_dim == 192 and head_dim_v == 128
    is_deepseek_mla_absorbed_shape = (head_dim == 64 or head_dim == head_dim_v) and head_dim_v == 512
    is_hdim256_shape = head_dim == 256 and head_dim_v == 256
    is_standard_range = 8 <= head_dim <= 128 and 8 <= head_dim_v <= 128
    is_sm90_range = 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256
    if compute_capability == 9:
        assert is_sm90_range and head_dim % alignment == 0 and head_dim_v % alignment == 0, (
            f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM90.")
    elif compute_capability in [10, 11]:
        assert (is_standard_range or is_deepseek_shape or is_deepseek_mla_absorbed_shape or is_hdim256_shape) \
            and head_dim % alignment == 0 and head_dim_v % alignment == 0, (
            f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM100/SM110.")


def _resolve_causal_local_window(causal, window_size_left, window_size_right, mask_mod=None):
    # interface.py _resolve_causal_local_window: -1 becomes None only when BOTH sides are negative
    if mask_mod is not None:
        return False, False, window_size_left, window_size_right
    if (window_size_left is not None and window_size_right is not None
            and window_size_left < 0 and window_size_right < 0):
        window_size_left = None
        window_size_right = None
    if causal:
        window_size_right = 0
    if window_size_left is not None or window_size_right is not None:
        if window_size_left is None and window_size_right == 0:
            causal, local = True, False
            window_size_right = None
        else:
            causal, local = False, True
    else:
        local = False
    return causal, local, window_size_left, window_size_right


def _keep(sq, sk, causal, local, left, right):
    # mask.py: bottom-right; causal_row_offset = seqlen_k - seqlen_q, col limits row + offset (+ right),
    # row + offset - left; bounds are used as given (no normalisation)
    m = torch.arange(sq).unsqueeze(1) + (sk - sq)
    n = torch.arange(sk).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= n <= m
    if local:
        if right is not None:
            keep &= n <= m + right
        if left is not None:
            keep &= n >= m - left
    return keep


def _scores(q, k, scale, softcap):
    # [B, S, H, D] -> float64 [B, H, Sq, Sk]; utils.create_softcap_scoremod: softcap*tanh(scale*s/softcap)
    h, hkv = q.shape[2], k.shape[2]
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    raw = qd @ kd.transpose(-1, -2) * scale
    if softcap:
        return softcap * torch.tanh(raw / softcap), raw
    return raw, raw


def _dense_fwd(q, k, v, scale, causal, local, left, right, softcap):
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    s, _ = _scores(q, k, scale, softcap)
    s = s.masked_fill(~_keep(sq, sk, causal, local, left, right), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                       # softmax.py finalize: natural log (x LN2)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)   # row_sum == 0: O = 0, lse = -inf
    vd = v.double().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    return (p @ vd).transpose(1, 2), lse


def _split(x, cu, i):
    return x[int(cu[i]):int(cu[i + 1])]


def _flash_attn_fwd(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
    causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
    tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None,
    _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None, lse=None,
    aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
    scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
    gather_bwd_recompute_p=False,
):
    FWD_CALLS.append(dict(causal=causal, window_size_left=window_size_left, window_size_right=window_size_right,
                          softcap=softcap, varlen=cu_seqlens_q is not None, head_dim=q.shape[-1]))
    requires_grad = any(t is not None and t.requires_grad for t in (q, k, v, qv, learnable_sink))
    num_head, head_dim = q.shape[-2:]
    num_head_kv, head_dim_v = v.shape[-2], v.shape[-1]
    # interface.py _flash_attn_fwd: shapes, dtypes, device, arch, heads, head dims
    if cu_seqlens_q is None:
        batch_size, seqlen_q = q.shape[:2]
        seqlen_k = v.shape[-3]
        assert k.shape == (batch_size, seqlen_k, num_head_kv, head_dim)
        assert v.shape == (batch_size, seqlen_k, num_head_kv, head_dim_v)
    else:
        batch_size = cu_seqlens_q.shape[0] - 1
        assert k.shape[1:] == (num_head_kv, head_dim)
        assert cu_seqlens_k.shape == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1,)"
        for t in (cu_seqlens_q, cu_seqlens_k):
            assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
    assert v.dtype in [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], (
        "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2")
    assert all(t is None or t.dtype == v.dtype for t in (q, k, qv)), "q, k, v, and qv must have the same dtype"
    assert all(_on_cuda(t) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)), "inputs must be on CUDA device"
    arch = _get_device_arch() if _arch is None else _arch
    assert arch // 10 in [8, 9, 10, 11, 12], "Unsupported compute capability. Supported: 8.x, 9.x, 10.x, 11.x, 12.x"
    assert num_head % num_head_kv == 0, "num_head must be divisible by num_head_kv"
    alignment = 16 // v.element_size()
    if arch // 10 not in [8, 12]:
        _validate_head_dims(head_dim, head_dim_v, arch // 10, alignment)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if softcap == 0.0:
        softcap = None
    causal, local, left, right = _resolve_causal_local_window(causal, window_size_left, window_size_right, mask_mod)
    want_lse = requires_grad or return_lse       # lse allocated only then (else None)
    if cu_seqlens_q is None:
        o, l = _dense_fwd(q, k, v, softmax_scale, causal, local, left, right, softcap)
        lse_t = l.float()                        # (batch_size, num_head, seqlen_q) float32
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for i in range(batch_size):
            o_i, l_i = _dense_fwd(_split(q, cq, i)[None], _split(k, ck, i)[None], _split(v, ck, i)[None],
                                  softmax_scale, causal, local, left, right, softcap)
            outs.append(o_i[0])
            lses.append(l_i[0])
        o = torch.cat(outs)
        lse_t = torch.cat(lses, dim=-1).float()  # (num_head, total_q)
    return o.to(q.dtype), (lse_t if want_lse else None), None, None, None


def _flash_attn_bwd(
    q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
    window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False, num_stages_Q=2,
    num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2,
    AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None, score_mod=None,
    score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None,
    learnable_sink=None,
):
    BWD_CALLS.append(dict(deterministic=deterministic, varlen=cu_seqlens_q is not None))
    arch = _get_device_arch()
    assert arch // 10 in [9, 10, 11, 12], "Unsupported compute capability. Supported: 9.x, 10.x, 11.x, 12.x"
    num_head, head_dim = q.shape[-2:]
    num_head_kv = k.shape[-2]
    if arch // 10 == 12:
        # interface.py _flash_attn_bwd, SM120 branch (checked before softcap becomes a score_mod)
        assert score_mod is None and score_mod_bwd is None, "score_mod backward not supported on SM 12.0"
        assert deterministic is False, "deterministic backward not supported on SM 12.0"
    if cu_seqlens_q is not None:
        total_q = q.shape[0]
        assert out.shape == (total_q, num_head, v.shape[-1])
        assert lse.shape == (num_head, total_q), "lse must have shape (num_head, total_q)"
    else:
        batch_size, seqlen_q = q.shape[:2]
        assert out.shape == (batch_size, seqlen_q, num_head, v.shape[-1])
        assert lse.shape == (batch_size, num_head, seqlen_q), "lse must have shape (batch_size, num_head, seqlen_q)"
    assert q.dtype in [torch.float16, torch.bfloat16], "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype, "inputs must have the same dtype"
    assert lse.dtype == torch.float32, "lse must be float32"
    assert all(_on_cuda(t) for t in (q, k, v, out, dout, lse)), "inputs must be on CUDA device"
    assert num_head % num_head_kv == 0, "num_head must be divisible by num_head_kv"
    if arch // 10 != 12:
        _validate_head_dims(head_dim, v.shape[-1], arch // 10, 16 // q.element_size())
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    causal, local, left, right = _resolve_causal_local_window(causal, window_size_left, window_size_right)
    softcap = softcap or 0.0
    if cu_seqlens_q is None:
        return _dense_bwd(q, k, v, out, dout, lse, softmax_scale, causal, local, left, right, softcap)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for i in range(len(cq) - 1):
        a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
        r = _dense_bwd(q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b], dout[None, a:b],
                       lse[None, :, a:b], softmax_scale, causal, local, left, right, softcap)
        gq[a:b], gk[c:d], gv[c:d] = r[0][0], r[1][0], r[2][0]
    return gq, gk, gv


def _dense_bwd(q, k, v, out, dout, lse, scale, causal, local, left, right, softcap):
    # the flash backward from the GIVEN out and lse: P = exp(S - lse), D = rowsum(dO * O)
    h, hkv = q.shape[2], k.shape[2]
    g = h // hkv
    s, raw = _scores(q, k, scale, softcap)
    keep = _keep(q.shape[1], k.shape[1], causal, local, left, right)
    p = torch.exp(s - lse.double().unsqueeze(-1)).masked_fill(~keep, 0.0)
    do = dout.double().transpose(1, 2)
    vd = v.double().transpose(1, 2).repeat_interleave(g, dim=1)
    dp = do @ vd.transpose(-1, -2)
    delta = (do * out.double().transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap:
        ds = ds * (1.0 - torch.tanh(raw / softcap) ** 2)
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(g, dim=1)
    dq = ds @ kd * scale
    dk = ds.transpose(-1, -2) @ qd * scale
    dv = p.transpose(-1, -2) @ do
    b, sk = k.shape[0], k.shape[1]
    dk = dk.reshape(b, hkv, g, sk, -1).sum(2)
    dv = dv.reshape(b, hkv, g, sk, -1).sum(2)
    return tuple(x.transpose(1, 2).to(q.dtype) for x in (dq, dk, dv))
'''


def files() -> dict:
    return {
        "flash_attn/__init__.py": "",
        "flash_attn/cute/__init__.py": '"""Stand-in for flash-attn-4 4.0.0b36 flash_attn.cute."""\n',
        "flash_attn/cute/interface.py": INTERFACE,
    }


def usp_case(**case):
    """Runs on each rank: the stand-in installed, cuda sm90 emulated, tests.dist_cases.usp_case
    with attn_type='fa4'; returns the normalised errors (<= 1 passes)."""
    from tests import dist_cases
    from usp_hal.dispatch import platform

    from .standin import standin_installed
    with standin_installed(dist=DIST, version=VERSION, files=files()), \
            platform.emulate("cuda", compute_capability=(9, 0)):
        return dist_cases.usp_case(attn_type="fa4", **case)
