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

import importlib.util
import math
import os
import shutil

import torch

from usp_hal.dispatch.backend import AttentionBackend, normalize_lse, pad_to
from usp_hal.dispatch.capabilities import KernelCall, Limit, Package, Positions, kernel_window

PACKAGE = Package(dist="flashinfer-python", module="flashinfer", min_version="0.2.0",
                  alt_dists=("flashinfer",), extra="flashinfer")
SRC = "flashinfer-ai/flashinfer"

KERNEL_HEAD_DIMS = (64, 128, 256)
LN2 = math.log(2.0)
POSITIONS = Positions(alignment="bottom-right", causal_any_lengths=False, window="left-only",
                      source=f"{SRC} v0.6.18 flashinfer/prefill.py single_prefill_with_kv_cache "
                             "(causal mask and window_left aligned to the bottom-right corner)")


def kernel_head_dim(head_dim: int) -> int:
    """The compiled head dim a call of this size runs with (after zero-padding)."""
    for size in KERNEL_HEAD_DIMS:
        if head_dim <= size:
            return size
    raise ValueError(f"flashinfer: head_dim={head_dim} > {KERNEL_HEAD_DIMS[-1]} is not supported")


def jit_reason() -> str:
    """Why FlashInfer cannot build its kernels here, or ''.  It compiles them on first use
    with nvcc (found through CUDA_HOME/CUDA_PATH, ``nvcc`` on PATH, or /usr/local/cuda) unless
    the ``flashinfer_jit_cache`` package provides them prebuilt."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return ""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    which = shutil.which("nvcc")
    if which:
        candidates.append(which)
    candidates.append("/usr/local/cuda/bin/nvcc")
    if any(os.path.isfile(c) and os.access(c, os.X_OK) for c in candidates):
        return ""
    return ("flashinfer compiles its kernels on first use and needs nvcc (a CUDA toolkit: set CUDA_HOME) or the "
            "prebuilt kernels of flashinfer-jit-cache; neither was found")


class FlashInferBackend(AttentionBackend):
    NAME = "flashinfer"
    DESCRIPTION = "FlashInfer single-request prefill (forward-only; base-2 lse converted to natural log)"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MIN = 1
    HEAD_DIM_MAX = 256
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True      # left bound only: LIMITS and POSITIONS
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = False
    SUPPORTS_DROPOUT = False
    SUPPORTS_GQA = True
    RETURNS_LSE = True
    HAS_BACKWARD = False
    MIN_COMPUTE_CAPABILITY = {"cuda": (7, 5)}
    REQUIRED_PACKAGES = (PACKAGE,)
    INPUT_LAYOUT = "contiguous"
    POSITIONS = POSITIONS
    LIMITS = (
        Limit("sliding window right bound without causal: FlashInfer windows are left-only (window_left); use "
              "window=(left, -1), or causal=True", uses=("right_window",), unless=("causal",),
              source=f"{SRC} v0.6.18 flashinfer/prefill.py single_prefill_with_kv_cache (window_left only)"),
        Limit("bf16 needs compute capability >= 8.0 (FlashInfer has no bf16 prefill kernels for {cc}); use fp16",
              uses=("bf16",), devices=("cuda",), archs=("sm80+",),
              source=f"{SRC} README (GPU support table); not re-checked against the kernels"),
        Limit("head_dim={head_dim} on {cc} needs flashinfer-python >= 0.6.16 (found {version})", devices=("cuda",),
              head_dims=(129, 256), version="<0.6.16", archs=("sm80+",),
              source="carried from the adapter's earlier reading of the release notes; not re-checked"),
    )
    UPSTREAM_CHECKED = (
        ("single_prefill_with_kv_cache signature, no batch dim, lse base 2 [S, H], bottom-right causal and "
         "window_left", f"{SRC} v0.6.18 flashinfer/prefill.py; include/flashinfer/attention/prefill.cuh"),
        ("JIT build needs nvcc or flashinfer-jit-cache", f"{SRC} v0.6.18 flashinfer/jit/cpp_ext.py get_cuda_path, "
                                                         "flashinfer/jit/env.py has_flashinfer_jit_cache"),
    )

    @classmethod
    def extra_availability(cls, device_type, version):
        return jit_reason()

    def kernel_forward(self, q, k, v, call: KernelCall):
        b, sq, h, d = q.shape
        sk = k.shape[1]
        k_causal, window_left, _ = kernel_window(POSITIONS, sq, sk, call.causal, call.window)
        softcap = call.softcap
        target = kernel_head_dim(d)
        qp, kp, vp = (pad_to(x, target) for x in (q, k, v))

        import flashinfer

        outs, lses = [], []
        for i in range(b):
            o, lse2 = flashinfer.single_prefill_with_kv_cache(
                qp[i], kp[i], vp[i], causal=bool(k_causal), kv_layout="NHD", sm_scale=call.scale,
                window_left=window_left, logits_soft_cap=float(softcap) if softcap else None,
                return_lse=True)
            outs.append(o)
            lses.append(lse2)
        out = torch.stack(outs)[..., :d].contiguous()
        lse = torch.stack(lses).transpose(1, 2).float() * LN2
        return out, normalize_lse(lse)
