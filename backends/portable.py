"""Portable attention in plain torch, tiled along queries and keys: every feature of the
kernel contract, forward and backward, on any device torch runs on.

It is the backend of last resort: ``attn_type="auto"`` picks it only when no backend of the
device's own list serves a call (and logs that once per reason), so a call that some fused
kernel can run never lands here.  What it gives in exchange for speed:

* every option of the contract: causal, two-sided windows and ALiBi at any key offset,
  softcap, a boolean ``mask=``, GQA/MQA without repeating K/V, a value head dim other than
  the query/key one (MLA), and the lse, so ring merges and sinks work as with any backend;
* a backward of its own that recomputes each tile's probabilities from the lse, as
  flash attention does (``dS = P * (dP - rowsum(dout * out))``, times ``1 - tanh^2`` under
  softcap), so it accepts the ring-merged ``out``/``lse`` of a ring block;
* bounded memory: a tile holds at most :attr:`PortableBackend.TILE_ELEMENTS` scores
  (``batch * heads * query rows * key columns``), never the ``Sq x Sk`` matrix of a call;
  the other buffers are the size of q, k, v and out (in the working precision);
* tiles that the call's causal/window bounds leave empty are skipped (no work, no memory).

Scores, softmax statistics and accumulators are in float32 (float64 for float64 inputs);
outputs and gradients come back in the input dtype.  The matmuls run in that working
precision, so fp16/bf16 inputs are upcast tile by tile (no fast half-precision path).
"""
from __future__ import annotations

from typing import Optional

import torch

from usp_hal.dispatch import platform as _platform
from usp_hal.dispatch.backend import AttentionBackend
from usp_hal.dispatch.capabilities import KernelCall


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Tiles:
    """One call's geometry: GQA views (``[B, Hkv, G, S, D]``), the masks and biases of a tile."""

    def __init__(self, q, k, v, call: KernelCall, tile_elements: int):
        self.b, self.sq, self.h, self.dk = q.shape
        self.sk, self.hkv, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.g = self.h // self.hkv
        self.work = _work(q.dtype)
        self.scale, self.causal = call.scale_for(self.dk), bool(call.causal)
        self.left, self.right = call.window
        self.softcap = float(call.softcap or 0.0)
        self.offset = int(call.key_offset)
        alibi_slopes, mask = call.alibi_slopes, call.mask
        self.device = q.device
        # [B, Hkv, G, S, D] views of q (no copy); k/v as [B, Hkv, 1, S, D] broadcast over the group
        self.qg = q.view(self.b, self.sq, self.hkv, self.g, self.dk).permute(0, 2, 3, 1, 4)
        self.kg = k.permute(0, 2, 1, 3).unsqueeze(2)
        self.vg = v.permute(0, 2, 1, 3).unsqueeze(2)
        self.slopes = None
        if alibi_slopes is not None:
            s = alibi_slopes.to(device=self.device, dtype=self.work)
            s = s.view(1, self.h) if s.dim() == 1 else s.view(self.b, self.h)
            self.slopes = s.view(s.shape[0], self.hkv, self.g, 1, 1)
        self.mask = None
        if mask is not None:
            m = mask.to(self.device)
            # [B|1, H|1, Sq, Sk] -> [B|1, Hkv|1, G|1, Sq, Sk] (a view whatever its strides)
            self.mask = m.unflatten(1, (self.hkv, self.g)) if m.shape[1] != 1 else m.unsqueeze(2)
        self.qc, self.kc = tile_shape(self.b, self.h, self.sq, self.sk, tile_elements)

    def row_chunks(self):
        return [(a, min(a + self.qc, self.sq)) for a in range(0, self.sq, self.qc)]

    def col_chunks(self, a: int, z: int):
        """The key chunks that rows ``a:z`` may see (causal/window bounds skip the rest)."""
        lo, hi = 0, self.sk                    # key indices n with a global position n + offset
        if self.causal:
            hi = min(hi, z - 1 - self.offset + 1)
        if self.right >= 0:
            hi = min(hi, z - 1 + self.right - self.offset + 1)
        if self.left >= 0:
            lo = max(lo, a - self.left - self.offset)
        if hi <= lo:
            return []
        return [(c, min(c + self.kc, hi)) for c in range(lo, hi, self.kc)]

    def keep(self, a: int, z: int, c: int, e: int) -> Optional[torch.Tensor]:
        """Bool ``[.., z-a, e-c]`` of the kept scores of a tile, or None when it keeps all."""
        keep = None
        if self.causal or self.left >= 0 or self.right >= 0:
            m = torch.arange(a, z, device=self.device).unsqueeze(1)
            n = torch.arange(c, e, device=self.device).unsqueeze(0) + self.offset
            dist = n - m
            keep = torch.ones(z - a, e - c, dtype=torch.bool, device=self.device)
            if self.causal:
                keep &= dist <= 0
            if self.left >= 0:
                keep &= dist >= -self.left
            if self.right >= 0:
                keep &= dist <= self.right
        if self.mask is not None:
            part = self.mask[..., a:z, c:e]
            keep = part if keep is None else keep & part
        return keep

    def scores(self, qt, kt, a: int, z: int, c: int, e: int):
        """``(s, tanh or None, keep)``: the tile's scores after softcap and ALiBi, masked to -inf."""
        s = torch.matmul(qt, kt.transpose(-1, -2)) * self.scale
        t = None
        if self.softcap:
            t = torch.tanh(s / self.softcap)
            s = t * self.softcap
        if self.slopes is not None:
            m = torch.arange(a, z, device=self.device, dtype=self.work).unsqueeze(1)
            n = torch.arange(c, e, device=self.device, dtype=self.work).unsqueeze(0) + self.offset
            s = s - self.slopes * (n - m).abs()
        keep = self.keep(a, z, c, e)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        return s, t, keep


class PortableBackend(AttentionBackend):
    NAME = "portable"
    DESCRIPTION = ("plain torch, tiled along queries and keys (bounded memory), own recomputing backward; every "
                   "option on every device; the fallback of auto")
    SUPPORTED_DEVICES = frozenset(_platform.PLATFORMS)
    SUPPORTED_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})
    SUPPORTS_DIFFERENT_V_DIM = True
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = True
    SUPPORTS_GQA = True
    SUPPORTS_KEY_OFFSET = True
    SUPPORTS_MASK = True
    RETURNS_LSE = True
    HAS_BACKWARD = True
    IS_DETERMINISTIC = True        # a fixed order of matmuls and sums, no atomics
    INPUT_LAYOUT = "strided"
    #: the most scores one tile holds (batch * heads * rows * columns): 1 Mi, 4 MiB in fp32; a tile's
    #: few temporaries (scores, probabilities, their gradient) are of that size
    TILE_ELEMENTS = 1 << 20
    UPSTREAM_CHECKED = (
        ("the whole kernel is this file's plain torch: forward and backward against float64 per feature "
         "(tests/test_portable_backend.py)", "usp-hal itself"),
    )

    def kernel_forward(self, q, k, v, call: KernelCall):
        T = _Tiles(q, k, v, call, int(self.TILE_ELEMENTS))
        w = T.work
        out = torch.zeros(T.b, T.hkv, T.g, T.sq, T.dv, dtype=w, device=q.device)
        lse = torch.full((T.b, T.hkv, T.g, T.sq), float("-inf"), dtype=w, device=q.device)
        for a, z in T.row_chunks():
            cols = T.col_chunks(a, z)
            if not cols:
                continue
            qt = T.qg[:, :, :, a:z].to(w)
            m = torch.full((T.b, T.hkv, T.g, z - a, 1), float("-inf"), dtype=w, device=q.device)
            den = torch.zeros_like(m)
            acc = torch.zeros(T.b, T.hkv, T.g, z - a, T.dv, dtype=w, device=q.device)
            for c, e in cols:
                s, _, _ = T.scores(qt, T.kg[:, :, :, c:e].to(w), a, z, c, e)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                base = m_new.masked_fill(torch.isneginf(m_new), 0.0)     # a row without keys so far: exp(-inf) = 0
                p = torch.exp(s - base)
                fix = torch.exp(m - base)
                den = den * fix + p.sum(-1, keepdim=True)
                acc = acc * fix + torch.matmul(p, T.vg[:, :, :, c:e].to(w))
                m = m_new
            seen = den > 0
            out[:, :, :, a:z] = torch.where(seen, acc / den.masked_fill(~seen, 1.0), 0.0)
            lse[:, :, :, a:z] = torch.where(seen, m + torch.log(den.masked_fill(~seen, 1.0)),
                                            float("-inf")).squeeze(-1)
        out = out.reshape(T.b, T.h, T.sq, T.dv).transpose(1, 2).to(q.dtype)
        return out, lse.reshape(T.b, T.h, T.sq)

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        T = _Tiles(q, k, v, call, int(self.TILE_ELEMENTS))
        w = T.work
        dq = torch.zeros(T.b, T.hkv, T.g, T.sq, T.dk, dtype=w, device=q.device)
        dk = torch.zeros(T.b, T.hkv, T.sk, T.dk, dtype=w, device=q.device)
        dv = torch.zeros(T.b, T.hkv, T.sk, T.dv, dtype=w, device=q.device)
        do_g = dout.view(T.b, T.sq, T.hkv, T.g, T.dv).permute(0, 2, 3, 1, 4)
        o_g = out.view(T.b, T.sq, T.hkv, T.g, T.dv).permute(0, 2, 3, 1, 4)
        # rows that saw no key (lse -inf) give no gradient: their probabilities are exp(s - inf) = 0
        lse_g = lse.to(w).view(T.b, T.hkv, T.g, T.sq, 1)
        lse_g = lse_g.masked_fill(torch.isneginf(lse_g), float("inf"))
        for a, z in T.row_chunks():
            cols = T.col_chunks(a, z)
            if not cols:
                continue
            qt, dot = T.qg[:, :, :, a:z].to(w), do_g[:, :, :, a:z].to(w)
            delta = (dot * o_g[:, :, :, a:z].to(w)).sum(-1, keepdim=True)        # rowsum(dout * out)
            lt = lse_g[:, :, :, a:z]
            dqt = torch.zeros_like(qt)
            for c, e in cols:
                kt, vt = T.kg[:, :, :, c:e].to(w), T.vg[:, :, :, c:e].to(w)
                s, t, _ = T.scores(qt, kt, a, z, c, e)
                p = torch.exp(s - lt)                                           # masked scores: exp(-inf) = 0
                dv[:, :, c:e] += torch.matmul(p.transpose(-1, -2), dot).sum(2)
                ds = p * (torch.matmul(dot, vt.transpose(-1, -2)) - delta)
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds * T.scale
                dqt += torch.matmul(ds, kt)
                dk[:, :, c:e] += torch.matmul(ds.transpose(-1, -2), qt).sum(2)
            dq[:, :, :, a:z] = dqt
        dq = dq.reshape(T.b, T.h, T.sq, T.dk).transpose(1, 2).to(q.dtype)
        return dq, dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def tile_shape(batch: int, heads: int, sq: int, sk: int, tile_elements: Optional[int] = None) -> tuple:
    """``(rows, columns)`` of the tiles a call of this size runs in (what bounds its memory)."""
    n = int(tile_elements or PortableBackend.TILE_ELEMENTS)
    per_row = max(1, batch * heads)
    kc = max(1, min(sk, max(16, n // (per_row * 128))))     # up to 128 rows of full-width columns
    qc = max(1, min(sq, n // (per_row * kc)))
    return qc, kc


__all__ = ["PortableBackend", "tile_shape"]
