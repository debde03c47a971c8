"""SageAttention (``sageattention``): quantised, forward-only attention.

SageAttention quantises Q/K to INT8 (and P·V to FP8 on sm89+ in v2), so its output
differs from exact attention by the quantisation error: it is *lossy*, never picked by
``attn_type="auto"``, and has no backward (inference kernels).

Two generations are in use and the adapter serves both:

* **v1** (PyPI ``sageattention`` 1.0.6, Triton only):
  ``sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True)``
  returns only the output.  Head dims must be exactly 64, 96 or 128, so the adapter
  zero-pads Q/K/V to the next of those (exact: zero columns add nothing to ``q.k`` and
  the scale is passed explicitly) and slices the output back.  With no lse, v1 can only
  serve Ulysses-only meshes (ring degree 1): a request that needs an lse is refused with
  that reason, and :meth:`SageFP8Backend.forward` returns ``(out, None)``.
* **v2+** (source build): ``sageattn(..., return_lse=True)`` also returns the lse
  ``[B, H, Sq]`` float32, already natural-log and corrected for K smoothing.  It
  dispatches on the GPU architecture and raises for any architecture it has no kernel
  for (e.g. sm100); that rule is a reason here.  v2 pads odd head dims itself.

The adapter always passes ``tensor_layout="NHD"`` (the contract's ``[B, S, H, D]``),
``is_causal=`` and ``sm_scale=``; causal is only accepted with ``Sq == Sk`` (Sage's
documented limit, and all the core ever asks for).  Window, softcap, alibi and dropout do
not exist in Sage and are refused, never dropped.  Note: Sage's CUDA wrappers call
``torch.cuda.set_device(v.device)`` as a side effect.
"""
from __future__ import annotations

from typing import Optional

import torch

from usp_hal import platform as _platform
from usp_hal.backend import AttentionBackend, installed_version, normalize_lse, pad_head_dim, parse_version
from usp_hal.capabilities import Package

PACKAGE = Package(dist="sageattention", module="sageattention", extra="sage")

# v1 kernels exist for exactly these head dims (smaller ones are zero-padded up).
V1_HEAD_DIMS = (64, 96, 128)
# v2's sageattn() has a kernel for these GPU architectures and raises for any other.
V2_ARCHS = ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1))


def has_return_lse(version: Optional[str]) -> bool:
    """Whether this sageattention version's ``sageattn`` takes ``return_lse`` (v2 and later)."""
    return version is not None and parse_version(version).major >= 2


def _arch_reason(version: Optional[str], cc) -> str:
    if cc is None or not has_return_lse(version) or tuple(cc) in V2_ARCHS:
        return ""
    archs = ", ".join(f"sm{a}{b}" for a, b in V2_ARCHS)
    return (f"sageattention {version} has no kernel for sm{cc[0]}{cc[1]} "
            f"(its sageattn() supports {archs})")


class SageFP8Backend(AttentionBackend):
    """SageAttention adapter.  ``forward`` returns ``(out, lse)``; with sageattention v1
    (no lse in the kernel) it returns ``(out, None)``: the core only asks this backend for
    an lse when :meth:`not_supported_reasons` allowed ``needs_lse``, which v1 never does."""

    NAME = "sage_fp8"
    DESCRIPTION = ("SageAttention INT8/FP8 quantised attention: lossy (quantisation error), "
                   "forward-only; lse from sageattention >= 2 only")
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MIN = 1
    HEAD_DIM_MAX = 128
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = False
    SUPPORTS_SOFTCAP = False
    SUPPORTS_ALIBI = False
    SUPPORTS_DROPOUT = False
    SUPPORTS_GQA = True
    RETURNS_LSE = True          # v2+; v1 is refused for needs_lse in extra_reasons
    HAS_BACKWARD = False
    MIN_COMPUTE_CAPABILITY = {"cuda": (8, 0)}
    REQUIRED_PACKAGES = (PACKAGE,)
    # Error budget against exact attention used when the probe verifies this lossy kernel
    # (INT8 Q/K, FP8 or FP16 P.V).  A declared budget, wider than the dtype's own rounding.
    LOSSY_TOLERANCES = {torch.float16: (5e-2, 5e-2), torch.bfloat16: (6e-2, 5e-2)}

    @classmethod
    def extra_reasons(cls, request):
        reasons = []
        version = installed_version(PACKAGE)
        if request.needs_lse and version is not None and not has_return_lse(version):
            reasons.append(
                f"sageattention {version} has no return_lse (v1 API), so it cannot give the lse that "
                "ring degree > 1 and return_attn_probs=True need: use ring_degree=1, or build "
                "sageattention >= 2 from source")
        arch = _arch_reason(version, request.compute_capability)
        if arch:
            reasons.append(arch)
        return reasons

    @classmethod
    def extra_availability(cls, device_type, version):
        if device_type != "cuda":
            return ""
        return _arch_reason(version, _platform.compute_capability(device_type))

    def __init__(self) -> None:
        self._version: Optional[str] = None

    def _installed(self) -> str:
        if self._version is None:
            version = installed_version(PACKAGE)
            if version is None:
                raise RuntimeError("sage_fp8: sageattention is not installed (pip install 'usp-hal[sage]')")
            self._version = version
        return self._version

    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        if tuple(window) != (-1, -1) or softcap or alibi_slopes is not None or dropout_p:
            raise NotImplementedError(
                "sage_fp8: SageAttention has no sliding window, softcap, alibi or dropout "
                f"(got window={tuple(window)}, softcap={softcap}, alibi={alibi_slopes is not None}, "
                f"dropout_p={dropout_p}); use a backend that declares them")
        sq, d = q.shape[1], q.shape[-1]
        if causal and sq != k.shape[1]:
            raise ValueError(f"sage_fp8: causal attention needs Sq == Sk (got Sq={sq}, Sk={k.shape[1]}); "
                             "SageAttention defines causal only for equal lengths")
        scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
        version = self._installed()
        from sageattention import sageattn

        if not has_return_lse(version):
            if d > V1_HEAD_DIMS[-1]:
                raise ValueError(f"sage_fp8: head_dim={d} > {V1_HEAD_DIMS[-1]} is not supported")
            target = next(size for size in V1_HEAD_DIMS if size >= d)
            qp, kp, vp = (pad_head_dim(x, target) for x in (q, k, v))
            out = sageattn(qp, kp, vp, tensor_layout="NHD", is_causal=bool(causal), sm_scale=scale)
            return out[..., :d].contiguous(), None

        out, lse = sageattn(q, k, v, tensor_layout="NHD", is_causal=bool(causal), sm_scale=scale,
                            return_lse=True)
        return out, normalize_lse(lse)
