"""FlashAttention-4 (the CuTe DSL kernels of flash-attention; distribution ``flash-attn-4``).

Written against flash-attn-4 4.0.0b36 (the PyPI wheel, module ``flash_attn.cute``; the wheel
has no ``flash_attn/__init__.py``, so with flash-attn 2 installed too the two share the
``flash_attn`` directory and importing ``flash_attn.cute`` runs flash-attn 2's
``__init__`` first).  The adapter calls the two functions under the public
``flash_attn_func`` (``flash_attn/cute/interface.py``): ``_flash_attn_fwd`` (``return_lse=True``)
and ``_flash_attn_bwd``, which takes ``out`` and ``lse`` as arguments, so a ring block's
backward can be given the merged ones.  Facts read from that file (and cited where used):

* dtypes fp16/bf16 (fp8 is forward-only and outside the contract); GQA with
  ``num_head % num_head_kv == 0``; head dims divisible by ``16 // element_size`` = 8 (the
  adapter pads to 8 and slices), 8..256 on SM90, 8..128 or 256 on SM100/SM110
  (``_validate_head_dims``); no check on SM80/SM120 (the shared-memory fit is not checked:
  ``# TODO: check @can_implement``).  A value head dim of its own (MLA) is taken:
  ``head_dim_v = v.shape[-1]`` sizes out and dv, and ``_validate_head_dims`` checks the pair
  (SM90 both 8..256; SM100/SM110 both 8..128, or (192, 128), or (64, 512)).
* forward dispatches compute capability 8.x-12.x; the backward asserts 9.x-12.x; on 12.x the
  backward asserts no score_mod (softcap is implemented as one) and no deterministic mode.
* lse ``[B, H, Sq]`` float32 (varlen ``[H, total_q]``), natural log (``softmax.py``
  ``finalize``: ``(row_max * scale_log2 + log2(row_sum)) * LN2``), ``-inf`` for a row with no
  key (also when ``Sk == 0``).
* causal and windows are aligned bottom-right (``mask.py``: ``causal_row_offset = seqlen_k -
  seqlen_q``) with no normalisation of large bounds; a window side is unbounded only when
  it is ``None`` (``_resolve_causal_local_window`` turns ``-1`` into ``None`` only when *both*
  sides are negative), so the adapter passes ``None`` for an open side.
* softcap ``softcap * tanh(scale * s / softcap)`` (``utils.create_softcap_scoremod``: the
  scale is applied before the score_mod); no alibi, no dropout, no position offset.

``mask=`` is not taken (``SUPPORTS_MASK = False``): FA4's ``mask_mod`` is a ``@cute.jit``
function compiled into the kernel (aux tensors are threaded to it), so a dense boolean mask
would need CuTe DSL code indexing a ``[B, H, Sq, Sk]`` aux tensor, which cannot be compiled
or run here.  Masked calls whose blocks are all full or empty still run on fa4; partial
blocks are refused with a reason naming sdpa/flex.  Learnable sinks are not used: the core
applies sinks through the lse.

None of this has run against the real kernel here (no GPU): tests/contract/ runs the adapter
on a stand-in with these signatures and checks, which proves the adapter, not the kernel.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os

import torch

from usp_hal.dispatch.backend import (
    AttentionBackend,
    BackendUnavailable,
    lse_for_backward,
    normalize_lse,
    pad_head_dim,
)
from usp_hal.dispatch.capabilities import KernelCall, Limit, Package, Positions, kernel_window

PACKAGE = Package(dist="flash-attn-4", module="flash_attn")
SRC = "flash-attn-4 4.0.0b36 flash_attn/cute/interface.py"
HEAD_DIM_MULTIPLE = 8          # 16 // element_size for fp16/bf16 (interface.py _flash_attn_fwd: alignment)

POSITIONS = Positions(alignment="bottom-right", causal_any_lengths=True, window="two-sided",
                      source="flash-attn-4 4.0.0b36 flash_attn/cute/mask.py (causal_row_offset = seqlen_k - seqlen_q); "
                             "interface.py _resolve_causal_local_window (no normalisation of large bounds)")

_FWD_PARAMS = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
               "causal", "softcap", "window_size_left", "window_size_right", "return_lse"}
_BWD_PARAMS = {"q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap", "window_size_left",
               "window_size_right", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "deterministic"}


def interface_path() -> "str | None":
    """``flash_attn/cute/interface.py``, found without importing anything."""
    spec = importlib.util.find_spec("flash_attn")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(loc, "cute", "interface.py")
        if os.path.isfile(path):
            return path
    return None


def _load_interface():
    try:
        iface = importlib.import_module("flash_attn.cute.interface")
    except Exception as exc:
        raise BackendUnavailable(f"fa4: importing flash_attn.cute.interface failed ({type(exc).__name__}: {exc})") \
            from exc
    for name, want in (("_flash_attn_fwd", _FWD_PARAMS), ("_flash_attn_bwd", _BWD_PARAMS)):
        fn = getattr(iface, name, None)
        try:
            params = set(inspect.signature(fn).parameters) if fn is not None else set()
        except (TypeError, ValueError):
            params = set()
        if not want <= params:
            raise BackendUnavailable(f"fa4: flash_attn.cute.interface.{name} does not take "
                                     f"{', '.join(sorted(want - params))}: an API this adapter does not know "
                                     "(written against flash-attn-4 4.0.0b36)")
    return iface


def _side(x: int):
    return None if x < 0 else int(x)


class FlashAttn4Backend(AttentionBackend):
    NAME = "fa4"
    DESCRIPTION = "FlashAttention-4 (flash-attn-4, CuTe DSL): forward/backward with lse, varlen"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MAX = 256                # padded to a multiple of 8 by the adapter
    # Dk != Dv: out and dv take v's head dim (interface.py _flash_attn_fwd: head_dim_v = v.shape[-1]); the pairs
    # each architecture takes are checked in not_supported_reasons (_validate_head_dims)
    SUPPORTS_DIFFERENT_V_DIM = True
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = False            # no alibi argument
    SUPPORTS_DROPOUT = False
    SUPPORTS_GQA = True
    SUPPORTS_KEY_OFFSET = False       # windows take no offset between ring blocks
    # a dense mask would have to be a CuTe DSL mask_mod reading an aux tensor: not verifiable here
    SUPPORTS_MASK = False
    RETURNS_LSE = True
    HAS_BACKWARD = True               # sm90+: LIMITS
    SUPPORTS_DETERMINISTIC = True     # not on sm12x: LIMITS
    VARLEN_KERNEL = True              # cu_seqlens_q/k of the same two functions
    MIN_COMPUTE_CAPABILITY = {"cuda": (8, 0)}
    REQUIRED_PACKAGES = (PACKAGE,)
    INPUT_LAYOUT = "last-dim-contiguous"
    POSITIONS = POSITIONS
    LIMITS = (
        Limit("flash-attn-4 {version} has no kernels for {cc} (it dispatches compute capability 8.x-12.x)",
              devices=("cuda",), archs=("sm8x", "sm9x", "sm10x", "sm11x", "sm12x"),
              source=f"{SRC} _flash_attn_fwd (assert arch // 10 in [8, 9, 10, 11, 12])"),
        Limit("backward on {cc}: flash-attn-4's backward runs on compute capability 9.x-12.x only",
              uses=("backward",), devices=("cuda",), archs=("sm90+",),
              source=f"{SRC} _flash_attn_bwd (assert arch // 10 in [9, 10, 11, 12])"),
        Limit("head_dim={head_dim} on {cc}: flash-attn-4 takes head dims 8..128 or 256 on SM100/SM110",
              devices=("cuda",), archs=("sm8x", "sm9x", "sm12x"), head_dims=(129, 248), pad_to=HEAD_DIM_MULTIPLE,
              unless=("dk_ne_dv",),      # the pairs (Dk, Dv) are checked by not_supported_reasons
              source=f"{SRC} _validate_head_dims (compute_capability in [10, 11])"),
        Limit("head_dim={head_dim} on {cc}: not checked to fit SM120's shared memory (flash-attn-4 does not check "
              "either: '# TODO: check @can_implement')", devices=("cuda",), archs=("sm8x", "sm9x", "sm10x", "sm11x"),
              head_dims=(129, 256), pad_to=HEAD_DIM_MULTIPLE,
              source=f"{SRC} _flash_attn_fwd/_flash_attn_bwd (no head-dim check for arch 12); "
                     "flash_fwd_sm120.py can_implement (99 KB)"),
        Limit("deterministic backward on {cc}: flash-attn-4 has none on SM120", uses=("deterministic",),
              devices=("cuda",), archs=("sm8x", "sm9x", "sm10x", "sm11x"),
              source=f"{SRC} _flash_attn_bwd (deterministic backward not supported on SM 12.0)"),
        Limit("softcap backward on {cc}: flash-attn-4 implements softcap as a score_mod and asserts 'score_mod "
              "backward not supported on SM 12.0'", uses=("softcap", "backward"), devices=("cuda",),
              archs=("sm8x", "sm9x", "sm10x", "sm11x"), source=f"{SRC} _flash_attn_bwd (arch // 10 == 12 branch)"),
    )
    UPSTREAM_CHECKED = (
        ("_flash_attn_fwd/_flash_attn_bwd signatures, fp16/bf16, head dims per architecture (multiple of 8), "
         "forward 8.x-12.x and backward 9.x-12.x, SM120 backward without score_mod/deterministic",
         f"{SRC} (wheel)"),
        ("lse natural log [B, H, Sq] (varlen [H, total_q]), -inf for rows without keys; bottom-right masks, "
         "window sides open only as None; softcap after the scale",
         "flash-attn-4 4.0.0b36 flash_attn/cute/softmax.py finalize, mask.py, interface.py "
         "_resolve_causal_local_window, utils.py create_softcap_scoremod"),
    )

    @classmethod
    def not_supported_reasons(cls, request):
        """The declared rules, and for Dk != Dv the (Dk, Dv) pairs of ``_validate_head_dims``
        (on head dims padded to 8): SM90 both 8..256; SM100/SM110 both 8..128 or (192, 128)
        (the (64, 512) absorbed shape is past this adapter's 256); SM120 no check upstream, so
        a value head dim above 128 is refused as the query one is (shared memory not checked)."""
        reasons = super().not_supported_reasons(request)
        dk, dv = request.head_dim, request.v_dim
        if dk == dv or request.device_type != "cuda":
            return reasons
        pk, pv = (-(-x // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE for x in (dk, dv))
        if pv > 256:
            reasons.append(f"value head_dim={dv}: flash-attn-4 takes at most 256")
        cc = request.compute_capability
        if cc is not None and cc[0] in (10, 11) and not ((pk <= 128 and pv <= 128) or (pk, pv) == (192, 128)):
            reasons.append(f"(head_dim, value head_dim)=({dk}, {dv}) on sm{cc[0]}{cc[1]}: flash-attn-4 takes both "
                           "8..128 or (192, 128) on SM100/SM110 (_validate_head_dims)")
        if cc is not None and cc[0] == 12 and pv > 128:
            reasons.append(f"value head_dim={dv} on sm{cc[0]}{cc[1]}: not checked to fit SM120's shared memory "
                           "(flash-attn-4 does not check either)")
        return reasons

    @classmethod
    def extra_availability(cls, device_type, version):
        if interface_path() is None:
            return "flash-attn-4 is installed but flash_attn/cute/interface.py is not found"
        return ""

    def _iface(self):
        iface = getattr(self, "_loaded_iface", None)
        if iface is None:
            iface = self._loaded_iface = _load_interface()
        return iface

    @staticmethod
    def _varlen(packing) -> dict:
        """The varlen arguments (q/k/v then hold the sequences back to back; the lse is [H, total_q])."""
        return packing.flash_kwargs() if packing is not None else {}

    def _fwd(self, q, k, v, call: KernelCall):
        """``call`` in the kernel's terms (its causal flag and window bounds)."""
        qp, kp, vp = (pad_head_dim(x, HEAD_DIM_MULTIPLE) for x in (q, k, v))
        left, right = call.window
        res = self._iface()._flash_attn_fwd(qp, kp, vp, softmax_scale=call.scale, causal=bool(call.causal),
                                            softcap=float(call.softcap or 0.0), window_size_left=_side(left),
                                            window_size_right=_side(right), return_lse=True,
                                            **self._varlen(call.packing))
        out, lse = res[0], res[1]
        if lse is None:
            raise RuntimeError("fa4: _flash_attn_fwd returned no lse although return_lse=True")
        return out[..., :v.shape[-1]], normalize_lse(lse)

    def _bwd(self, dout, q, k, v, out, lse, call: KernelCall):
        d, dv = q.shape[-1], v.shape[-1]
        left, right = call.window
        dop, qp, kp, vp, op = (pad_head_dim(x, HEAD_DIM_MULTIPLE)
                               for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        lse_k = lse_for_backward(lse).to(torch.float32).contiguous()
        res = self._iface()._flash_attn_bwd(qp, kp, vp, op, dop, lse_k, softmax_scale=call.scale,
                                            causal=bool(call.causal), softcap=float(call.softcap or 0.0),
                                            window_size_left=_side(left), window_size_right=_side(right),
                                            deterministic=bool(call.deterministic), **self._varlen(call.packing))
        return res[0][..., :d], res[1][..., :d], res[2][..., :dv]

    @staticmethod
    def _kernel_call(q, k, call: KernelCall) -> KernelCall:
        """``call`` in the kernel's terms: its bottom-right causal flag and window (or refused)."""
        k_causal, left, right = kernel_window(POSITIONS, q.shape[1], k.shape[1], call.causal, call.window)
        return call.with_(causal=k_causal, window=(left, right))

    def kernel_forward(self, q, k, v, call: KernelCall):
        return self._fwd(q, k, v, self._kernel_call(q, k, call))

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        return self._bwd(dout, q, k, v, out, lse, self._kernel_call(q, k, call))

    # packed: causal/window are asked only for sequences with Sq == Sk and no offset (no translation)
    def kernel_forward_packed(self, q, k, v, call: KernelCall):
        return self._fwd(q, k, v, call)

    def kernel_backward_packed(self, dout, q, k, v, out, lse, call: KernelCall):
        return self._bwd(dout, q, k, v, out, lse, call)
