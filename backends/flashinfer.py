"""FlashInfer (``flashinfer-python``, import ``flashinfer``): forward-only prefill attention.

Kernel entry point::

    flashinfer.single_prefill_with_kv_cache(q [Sq, H, D], k, v [Sk, Hkv, D], causal=,
        kv_layout="NHD", sm_scale=, window_left=, logits_soft_cap=, return_lse=True)
        -> (out [Sq, H, D], lse [Sq, H] float32, BASE 2)

What the adapter does to meet the contract:

* **No batch dim** in the single-request API: the adapter runs it once per batch entry
  and stacks the results (``B > 1`` is supported, not refused).
* **lse is base 2 and [S, H]**: multiplied by ln 2 and transposed to ``[B, H, S]``.
* **Head dims**: FlashInfer compiles kernels for 64, 128 and 256; other sizes up to 256
  are zero-padded to the next of those (exact: the scale is passed explicitly) and the
  output is sliced back.
* **Window is left-only** (``window_left``) and aligned bottom-right, like its causal
  mask.  A right bound is only accepted together with ``causal`` (where causal already
  bounds the right side); for ``Sq != Sk`` the left bound is shifted so the kept keys
  are exactly the contract's top-left ones (a call where that would leave a row with no
  key is refused).  Causal itself needs ``Sq == Sk``.
* softcap maps to ``logits_soft_cap`` (``cap * tanh(scale * q.k / cap)``, as in the
  contract).  Alibi (FlashInfer derives its own slopes), dropout and ring position
  offsets are refused, never dropped.  There is no backward.
"""
from __future__ import annotations

import math

import torch

from usp_hal.backend import AttentionBackend, installed_version, normalize_lse, pad_head_dim, parse_version
from usp_hal.capabilities import Package

PACKAGE = Package(dist="flashinfer-python", module="flashinfer", min_version="0.2.0",
                  alt_dists=("flashinfer",), extra="flashinfer")

KERNEL_HEAD_DIMS = (64, 128, 256)
LN2 = math.log(2.0)
# On sm75 the 256 head-dim prefill kernel exceeded shared memory until this release.
SM75_HEAD_DIM_256_FROM = "0.6.16"


def kernel_head_dim(head_dim: int) -> int:
    """The compiled head dim a call of this size runs with (after zero-padding)."""
    for size in KERNEL_HEAD_DIMS:
        if head_dim <= size:
            return size
    raise ValueError(f"flashinfer: head_dim={head_dim} > {KERNEL_HEAD_DIMS[-1]} is not supported")


class FlashInferBackend(AttentionBackend):
    NAME = "flashinfer"
    DESCRIPTION = "FlashInfer single-request prefill (forward-only; base-2 lse converted to natural log)"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MIN = 1
    HEAD_DIM_MAX = 256
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True      # left bound only: see extra_reasons
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = False
    SUPPORTS_DROPOUT = False
    SUPPORTS_GQA = True
    RETURNS_LSE = True
    HAS_BACKWARD = False
    MIN_COMPUTE_CAPABILITY = {"cuda": (7, 5)}
    REQUIRED_PACKAGES = (PACKAGE,)

    @classmethod
    def extra_reasons(cls, request):
        reasons = []
        right = tuple(request.window)[1]
        if right >= 0 and not request.causal:
            reasons.append(f"sliding window right bound {right} without causal: FlashInfer windows are "
                           "left-only (window_left); use window=(left, -1), or causal=True")
        cc = request.compute_capability
        if cc is not None and tuple(cc) < (8, 0):
            if request.dtype == torch.bfloat16:
                reasons.append(f"bf16 needs compute capability >= 8.0 (FlashInfer has no bf16 prefill "
                               f"kernels for sm{cc[0]}{cc[1]}); use fp16")
            version = installed_version(PACKAGE)
            if (request.head_dim > 128 and version is not None
                    and parse_version(version) < parse_version(SM75_HEAD_DIM_256_FROM)):
                reasons.append(f"head_dim={request.head_dim} on sm{cc[0]}{cc[1]} needs flashinfer-python >= "
                               f"{SM75_HEAD_DIM_256_FROM} (found {version})")
        return reasons

    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        if alibi_slopes is not None or dropout_p:
            raise NotImplementedError("flashinfer: alibi_slopes and dropout are not supported "
                                      f"(alibi={alibi_slopes is not None}, dropout_p={dropout_p})")
        left, right = (int(w) for w in window)
        if key_offset and (left >= 0 or right >= 0):
            raise NotImplementedError("flashinfer: a window across ring blocks (key_offset="
                                      f"{key_offset}) cannot be expressed; use ring_degree=1")
        if right >= 0 and not causal:
            raise NotImplementedError(f"flashinfer: window right bound {right} needs causal=True "
                                      "(FlashInfer windows are left-only)")
        b, sq, h, d = q.shape
        sk = k.shape[1]
        if causal and sq != sk:
            raise ValueError(f"flashinfer: causal attention needs Sq == Sk (got Sq={sq}, Sk={sk}); "
                             "FlashInfer aligns its causal mask bottom-right")
        window_left = -1
        if left >= 0:
            # FlashInfer keeps key n for query m when n >= m - window_left + (Sk - Sq).
            window_left = left + sk - sq
            if window_left < 0:
                raise ValueError(f"flashinfer: window left={left} with Sq={sq} > Sk={sk} + left gives rows "
                                 "no key, which FlashInfer's bottom-right window cannot express; use equal "
                                 "lengths or a backend that takes any window (e.g. sdpa)")
        scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
        target = kernel_head_dim(d)
        qp, kp, vp = (pad_head_dim(x, target).contiguous() for x in (q, k, v))

        import flashinfer

        outs, lses = [], []
        for i in range(b):
            o, lse2 = flashinfer.single_prefill_with_kv_cache(
                qp[i], kp[i], vp[i], causal=bool(causal), kv_layout="NHD", sm_scale=scale,
                window_left=window_left, logits_soft_cap=float(softcap) if softcap else None,
                return_lse=True)
            outs.append(o)
            lses.append(lse2)
        out = torch.stack(outs)[..., :d].contiguous()
        lse = torch.stack(lses).transpose(1, 2).float() * LN2
        return out, normalize_lse(lse)
