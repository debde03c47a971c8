"""Plain float64 attention: the single-process truth that every test, the probe's
``--verify`` and ``usp-hal run`` compare against.  Differentiable (autograd gives the
reference gradients).  Semantics are the kernel contract's (see ``usp_hal.dispatch.backend``)."""
from __future__ import annotations

import math

import torch

from ..sequence.positions import as_cu_seqlens

TOLERANCES = {  # (atol, rtol) for a result computed in this dtype vs the float64 reference
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


# lse is float32 for every input dtype, but a kernel fed bf16/fp16 computes its scores at
# that precision, so the lse inherits an error of about 1e-4 there
LSE_TOLERANCES = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-3, 1e-3),
}


def tolerance(dtype: torch.dtype, lse: bool = False) -> tuple:
    """(atol, rtol) for a result computed from inputs of ``dtype`` (``lse=True``: its lse)."""
    return (LSE_TOLERANCES if lse else TOLERANCES)[dtype]


def reference_attention(q, k, v, *, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                        alibi_slopes=None, key_offset=0, dtype=torch.float64, mask=None, sinks=None):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq]) in ``dtype``.

    Causal is top-left aligned with global positions ``m`` (query) and ``n + key_offset``
    (key).  Rows that see no key give out 0 and lse -inf.  ``mask``: a bool tensor
    broadcastable to [B, H, Sq, Sk] (True = attend), and'ed with the rest; ``sinks`` [H]: one
    more logit per head in every row's denominator (its value is zero), included in the lse.
    """
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"heads={h} is not a multiple of kv_heads={hkv}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    if hkv != h:
        kd = kd.repeat_interleave(h // hkv, dim=1)
        vd = vd.repeat_interleave(h // hkv, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    m = torch.arange(sq, device=q.device).unsqueeze(1)
    n = torch.arange(sk, device=q.device).unsqueeze(0) + key_offset
    dist = n - m
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= dist <= 0
    if window[0] >= 0:
        keep &= dist >= -window[0]
    if window[1] >= 0:
        keep &= dist <= window[1]
    if alibi_slopes is not None:
        sl = alibi_slopes.to(dtype)
        sl = sl.view(1, h, 1, 1) if sl.dim() == 1 else sl.view(b, h, 1, 1)
        s = s - sl * dist.abs().to(dtype)
    if mask is not None:
        keep = keep & mask.to(q.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(dtype).view(1, -1, 1))
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse.unsqueeze(-1)), 0.0))
    p = p.masked_fill(~keep, 0.0)
    out = torch.matmul(p, vd).transpose(1, 2)
    return out, lse


def reference_packed_attention(q, k, v, cu_seqlens, **kw):
    """Float64 single-process attention of every document on its own, concatenated:
    the truth a packed USP call is compared against (``usp_hal.dispatch.reference``, per document).
    ``kw``: the arguments of :func:`usp_hal.dispatch.reference.reference_attention`."""
    cu = as_cu_seqlens(cu_seqlens, q.shape[1])
    parts = [reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], **kw) for a, b in zip(cu, cu[1:])]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)
