"""SageAttention (``sageattention``): quantised, forward-only attention.

SageAttention quantises Q/K to INT8 (and P·V to FP8 on sm89+ in v2), so its output
differs from exact attention by the quantisation error: it is *lossy*, never picked by
``attn_type="auto"``, and has no backward (inference kernels).

Two generations are in use and the adapter serves both (facts read from the 1.0.6 wheel
and from thu-ml/SageAttention v2.0.1, v2.2.0 and main):

* **v1** (PyPI ``sageattention`` 1.0.6, Triton only):
  ``sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True)``
  returns only the output, asserts head dims 64, 96 or 128, asserts ``qo_len == kv_len``
  for causal, and with ``smooth_k`` runs ``k -= km`` **in place** on the tensor it is
  given.  The adapter zero-pads Q/K/V to the next of those head dims (exact: zero columns
  add nothing to ``q.k`` and the scale is passed explicitly), slices the output back, and
  hands the kernel its own copy of K whenever no padded copy was made, so the caller's K
  is never modified.  Without an lse, v1 serves Ulysses-only meshes: a request that needs
  an lse is refused for versions below 2 (a declared :class:`Limit`).  Its non-causal
  kernel (``attn_qk_int8_per_block.py`` ``_attn_fwd_inner``) loads the last, partial block
  of 64 keys with a mask but never masks the scores: the padding rows count as keys with
  score 0 and value 0, so the output is too small whenever ``Sk % 64 != 0`` (seen under
  the Triton interpreter: relative RMS error 0.14 at S=100, 0.67 at S=16).  Those calls are
  refused (:class:`KeyBlockLimit`); causal calls are right (the padding lies above the
  diagonal of the equal-length square).
* **v2** (source builds): ``sageattn(..., return_lse=True)`` also returns the lse
  ``[B, H, Sq]`` float32, natural log, corrected for K smoothing.  It dispatches on the GPU
  architecture and raises for any other: sm80/86/89/90 up to 2.1.0, plus sm120 from 2.1.1
  (sm121 only in builds after the 2.2.0 release, which still report 2.2.0).  Until the
  2.2.0 release its smoothing correction of the lse ignored GQA (shape error for
  ``1 < Hkv < H``), and the 2.2.0 sm86 (Triton) path repeats K's mean along the wrong
  axis for the ``NHD`` layout; the adapter therefore repeats K/V heads for GQA calls, which
  is exact.  The sm86 route of ``sageattn`` is the Triton kernel of v1 with an lse, and it
  has the same unmasked padding until thu-ml/SageAttention 499828b (2025-08-04, in the
  v2.2.0 tag): refused for versions below 2.2.0 on sm86.  Builds from 2025-06-27 to
  2025-08-04 already call themselves 2.2.0 and cannot be told apart by their version.

The adapter always passes ``tensor_layout="NHD"`` (the contract's ``[B, S, H, D]``),
``is_causal=`` and ``sm_scale=``.  Window, softcap, alibi and dropout do not exist in Sage
and are refused, never dropped.  Note: Sage v2's CUDA wrappers call
``torch.cuda.set_device(v.device)`` as a side effect.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from usp_hal.dispatch.backend import AttentionBackend, installed_version, normalize_lse, pad_to, parse_version
from usp_hal.dispatch.capabilities import (
    AttnRequest,
    KernelCall,
    Limit,
    Package,
    Positions,
    RuleContext,
    _arch_matches,
)

PACKAGE = Package(dist="sageattention", module="sageattention", extra="sage")
SRC = "thu-ml/SageAttention"

# v1 kernels exist for exactly these head dims (smaller ones are zero-padded up).
V1_HEAD_DIMS = (64, 96, 128)

_V2_ARCH_REASON = ("sageattention {version}'s sageattn() has no kernel for {cc} (it dispatches {archs}); "
                   "use another backend on this GPU")


def _arch_limit(version: str, archs: tuple, source: str) -> Limit:
    names = ", ".join(archs)
    return Limit(_V2_ARCH_REASON.replace("{archs}", names), devices=("cuda",), version=version, archs=archs,
                 source=source)


@dataclass(frozen=True)
class KeyBlockLimit(Limit):
    """A :class:`Limit` that also needs a key length that is not a multiple of ``key_block``
    (known only per call: dispatch without lengths never fires it, each kernel call and the
    core's per-block check do), and, with ``on_archs``, one of those architectures."""

    key_block: int = 64
    on_archs: tuple = ()

    def fires(self, req: AttnRequest, ctx: RuleContext) -> Optional[str]:
        sk = req.seqlen_k
        if sk is None or sk % self.key_block == 0:
            return None
        if self.on_archs:
            cc = req.compute_capability
            if cc is None or not any(_arch_matches(cc, a) for a in self.on_archs):
                return None
        why = super().fires(req, ctx)
        return f"{why} (here Sk={sk})" if why else None

    def condition(self) -> str:
        parts = [super().condition()] if super().condition() != "always" else []
        if self.on_archs:
            parts.append("on " + ", ".join(self.on_archs))
        parts.append(f"Sk not a multiple of {self.key_block}")
        return ", ".join(parts)


_PADDING = ("sageattention {version}'s non-causal Triton kernel counts the zero padding of the last block of 64 "
            "keys as keys (scores are not masked), so with a key length that is not a multiple of 64 its output is "
            "wrong: use causal=True, a key length that is a multiple of 64, or attn_type='sdpa'/'fa2'")

LIMITS = (
    KeyBlockLimit(_PADDING, unless=("causal",), version="<2",
                  source="sageattention 1.0.6 wheel, sageattention/attn_qk_int8_per_block.py _attn_fwd_inner (k "
                         "loaded with a mask, qk never masked); seen under the Triton interpreter"),
    KeyBlockLimit(_PADDING + " (or sageattention >= 2.2.0)", unless=("causal",), version=">=2,<2.2.0",
                  devices=("cuda",), on_archs=("sm86",),
                  source=f"{SRC} v2.0.1 sageattention/triton/attn_qk_int8_per_block.py _attn_fwd_inner (sm86 route); "
                         "masked from 499828b (2025-08-04, v2.2.0)"),
    Limit("sageattention {version} has no return_lse (the v1 API), so it cannot give the lse that ring "
          "degree > 1 and return_lse=True need: use ring_degree=1, or build sageattention >= 2 from source",
          uses=("lse",), version="<2",
          source="sageattention 1.0.6 wheel, sageattention/core.py sageattn (returns o only)"),
    _arch_limit(">=2,<2.1.1", ("sm80", "sm86", "sm89", "sm90"),
                f"{SRC} v2.0.1 sageattention/core.py sageattn (arch dispatch)"),
    _arch_limit(">=2.1.1,<=2.2.0", ("sm80", "sm86", "sm89", "sm90", "sm120"),
                f"{SRC} 4b0824d (2.1.1, sm120) and v2.2.0 sageattention/core.py sageattn"),
    _arch_limit(">2.2.0", ("sm80", "sm86", "sm89", "sm90", "sm120", "sm121"),
                f"{SRC} main sageattention/core.py sageattn (sm121 after the 2.2.0 release)"),
)


def has_return_lse(version) -> bool:
    """Whether this sageattention version's ``sageattn`` takes ``return_lse`` (v2 and later)."""
    return version is not None and parse_version(version).major >= 2


class SageFP8Backend(AttentionBackend):
    """SageAttention adapter.  ``forward`` returns ``(out, lse)``; with sageattention v1
    (no lse in the kernel) the lse is NaN and dispatch never lets it be used."""

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
    RETURNS_LSE = True          # v2+; v1 is refused for needs_lse (LIMITS)
    HAS_BACKWARD = False
    MIN_COMPUTE_CAPABILITY = {"cuda": (8, 0)}
    REQUIRED_PACKAGES = (PACKAGE,)
    INPUT_LAYOUT = "last-dim-contiguous"     # both generations assert q/k/v.stride(-1) == 1
    POSITIONS = Positions(causal_any_lengths=False, window="none",
                          source="sageattention 1.0.6 attn_qk_int8_per_block_causal.py forward "
                                 "(assert qo_len == kv_len); v2 docstring")
    LIMITS = LIMITS
    # Error budget against exact attention used when the probe verifies this lossy kernel
    # (INT8 Q/K, FP8 or FP16 P.V).  A declared budget, wider than the dtype's own rounding.
    LOSSY_TOLERANCES = {torch.float16: (5e-2, 5e-2), torch.bfloat16: (6e-2, 5e-2)}
    UPSTREAM_CHECKED = (
        ("v1: out only, head dims 64/96/128, causal needs equal lengths, k -= km in place",
         "sageattention 1.0.6 wheel sageattention/core.py sageattn"),
        ("v2: return_lse, architectures per version, lse smoothing correction and GQA",
         f"{SRC} v2.0.1, 4b0824d (2.1.1), v2.2.0, main sageattention/core.py, setup.py"),
    )

    #: what tests/real/ runs on the real package under the Triton interpreter (docs)
    INTERPRETER_CHECKED = (
        ("1.0.6: fp16/bf16 forward through the adapter (head dims 40 padded, 64, 96, 128; GQA/MQA; causal; S 16-256) "
         "and through LongContextAttention (1 rank, Ulysses-2); the padded-key flaw of non-causal calls with "
         "Sk % 64 != 0 in the kernel itself, and its refusal; Ring-2 refused (no lse)",
         "v2 (source builds, no wheel), the CUDA kernels of sm80/89/90, the INT8/FP8 tensor-core rounding, "
         "the values masked loads give on a GPU"),
    )

    def _installed(self) -> str:
        version = self.__dict__.get("_version")
        if version is None:
            version = installed_version(PACKAGE)
            if version is None:
                raise RuntimeError("sage_fp8: sageattention is not installed (pip install 'usp-hal[sage]')")
            self.__dict__["_version"] = version
        return version

    def kernel_forward(self, q, k, v, call: KernelCall):
        d, causal, softmax_scale = q.shape[-1], call.causal, call.scale
        version = self._installed()
        from sageattention import sageattn

        if not has_return_lse(version):
            target = next(size for size in V1_HEAD_DIMS if size >= d)
            qp, kp, vp = (pad_to(x, target) for x in (q, k, v))
            if kp is k:
                kp = k.clone()      # v1 subtracts K's mean from the tensor it is given
            out = sageattn(qp, kp, vp, tensor_layout="NHD", is_causal=bool(causal), sm_scale=softmax_scale)
            return out[..., :d].contiguous(), None

        h, hkv = q.shape[2], k.shape[2]
        if hkv != h:
            k, v = (x.repeat_interleave(h // hkv, dim=2) for x in (k, v))
        out, lse = sageattn(q, k, v, tensor_layout="NHD", is_causal=bool(causal), sm_scale=softmax_scale,
                            return_lse=True)
        return out, normalize_lse(lse)
