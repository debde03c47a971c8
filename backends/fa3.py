"""FlashAttention-3 (the ``hopper/`` build of flash-attention; distribution ``flash_attn_3``).

FA3 is not on PyPI: it is built from the ``hopper/`` directory of Dao-AILab/flash-attention.
It installs the top-level module ``flash_attn_interface`` (recent builds also re-export it
as ``flash_attn_3.flash_attn_interface``) and the package ``flash_attn_3`` with the compiled
extension.  The adapter imports the top-level module, falling back to the package path.

FA3 version numbers do not track its Python API, so the API generation is read from the
signatures of ``_flash_attn_forward`` / ``_flash_attn_backward`` (through the wrapped
function of a ``torch.library.custom_op``):

* old (before the July 2025 torch.compile rework): the forward takes ``out`` and
  ``window_size=(l, r)`` (many arguments without defaults) and returns
  ``(out, softmax_lse, *rest)``; the backward takes ``causal=`` and ``window_size=`` and
  returns ``(dq, dk, dv, softmax_d)``;
* new (custom ops): the forward takes ``window_size_left/right`` and returns
  ``(out, softmax_lse, out_accum, softmax_lse_accum)``; the backward takes ``is_causal=``
  (and the misspelled ``sequed_q/sequed_k``), writes ``dq/dk/dv`` in place and returns
  ``softmax_d``.

Contract work shared with FA2 (see :mod:`usp_hal.backends.fa2`): head dims padded to a
multiple of 8 and sliced back, an explicit scale from the unpadded head dim, bottom-right
positions translated (or refused) for ``Sq != Sk``, lse normalised (FA3 already writes
``-inf`` for a row with no key, but ``+inf`` when there are no keys at all), and
``-inf`` rows turned into ``+inf`` before the backward so they contribute nothing.

Packed documents (``VARLEN_KERNEL``): the same two functions take ``cu_seqlens_q/k`` and
``max_seqlen_q/k``, the lse is then ``[H, total_q]``.  A build compiled with
``FLASHATTENTION_DISABLE_VARLEN`` refuses them; the adapter notices on the first packed call
and serves packed calls with one dense call per sequence from then on.

A value head dim of its own (MLA) is taken on Hopper for Q/K in (128, 192] with V in
(96, 128] (DeepSeek's 192/128), or Q/K <= 64 with V <= 512 (``hopper/flash_api.cpp``
``mha_fwd`` at 0251105a); the backward rounds ``max(Dk, Dv)`` and takes at most 256
(``mha_bwd``), so this adapter declares V <= 256.  q/k and v are padded to 8 apart and out/dv
sliced to the value head dim.

FA3 has no dropout and no alibi; softcap and sliding windows are supported (without a
position offset between ring blocks).  Its kernels are compiled for ``sm_90a`` (plus sm80
kernels unless built without them, ``hopper/setup.py``); this adapter declares sm90 only,
with an upper bound, since sm_90a code does not run on sm100/sm120.  FA3's own window
normalisation (a right bound ``>= Sq - 1`` is unbounded) is exact, so windows with
``Sq != Sk`` are translated whenever they are expressible.  Builds from before the
2025-01-07 refactor (no ``softcap`` argument; they still dropped right bounds ``>= Sk``) are
not recognised and reported unavailable.

Builds from 2025-07-16 to 2025-08-19 register ``flash_attn::_flash_attn_forward``, the name
flash-attn >= 2.7 registers too: with both imported, the later import replaces the other's
operator.  Availability reads both interface files (nothing is imported) and reports that
combination as unavailable; the loader also checks the operator it gets is its own.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os

import torch

from usp_hal.backends.fa2 import (
    KERNEL_HEAD_DIM_MULTIPLE,
    custom_op_namespace,
    fa2_interface_path,
    foreign_op,
    signature_parameters,
    unpad,
)
from usp_hal.backends.fa2 import (
    PACKAGE as FA2_PACKAGE,
)
from usp_hal.dispatch.backend import (
    AttentionBackend,
    BackendUnavailable,
    installed_version,
    lse_for_backward,
    normalize_lse,
    pad_head_dim,
)
from usp_hal.dispatch.capabilities import Availability, KernelCall, Limit, Package, Positions, kernel_window

PACKAGE = Package(dist="flash_attn_3", module="flash_attn_interface", alt_dists=("flash-attn-3",), wheel=False)
BUILD_HINT = "not on PyPI: build it from the hopper/ directory of Dao-AILab/flash-attention"
SRC = "Dao-AILab/flash-attention"

POSITIONS = Positions(alignment="bottom-right", causal_any_lengths=True, window="two-sided",
                      right_unbounded_from="seqlen_q",
                      source=f"{SRC} hopper/flash_api.cpp mha_fwd (since 7a802796, 2025-01-07: "
                             "if (window_size_right >= seqlen_q - 1) window_size_right = -1)")


def fa3_interface_path() -> "str | None":
    """The FA3 ``flash_attn_interface.py`` (top-level, else the package copy), found without importing it."""
    spec = importlib.util.find_spec("flash_attn_interface")
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        return spec.origin
    spec = importlib.util.find_spec("flash_attn_3")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(loc, "flash_attn_interface.py")
        if os.path.isfile(path):
            return path
    return None


def op_clash() -> str:
    """Why FA3 and the installed flash-attn cannot share a process, or ''."""
    ns3 = custom_op_namespace(fa3_interface_path())
    if ns3 is None or installed_version(FA2_PACKAGE) is None:
        return ""
    ns2 = custom_op_namespace(fa2_interface_path())
    if ns2 != ns3:
        return ""
    return (f"this FlashAttention-3 build registers {ns3}::_flash_attn_forward, the operator name "
            f"flash-attn {installed_version(FA2_PACKAGE)} registers too (FA3 builds of 2025-07-16..2025-08-19): "
            "in one process the later import replaces the other's operator; rebuild FlashAttention-3 from a "
            "later commit (namespace flash_attn_3::) or uninstall flash-attn")


def _parameters(fn) -> dict:
    """Parameters of ``fn`` (through a torch.library custom op); unreadable ones make FA3 unavailable."""
    params = signature_parameters(fn)
    if params is None:
        raise BackendUnavailable(f"fa3: cannot read the signature of {fn!r} to tell its API generation")
    return params


class _FA3Kernel:
    """One imported ``flash_attn_interface`` and its API generation ("old" or "new")."""

    def __init__(self, iface) -> None:
        self.iface = iface
        fwd = _parameters(iface._flash_attn_forward)
        bwd = _parameters(iface._flash_attn_backward)
        if {"window_size_left", "window_size_right"} <= fwd.keys() and "is_causal" in bwd:
            self.api = "new"
        elif {"window_size", "causal", "softcap"} <= fwd.keys() and {"causal", "window_size"} <= bwd.keys():
            self.api = "old"
        else:
            raise BackendUnavailable(
                "fa3: unrecognised flash_attn_interface API (forward parameters: "
                f"{', '.join(fwd)}; backward parameters: {', '.join(bwd)}); this adapter knows the "
                "window_size=(l, r) API and the window_size_left/right custom-op API")
        self._fwd_required = [n for n, p in fwd.items() if p.default is inspect.Parameter.empty]
        self._bwd_required = [n for n, p in bwd.items() if p.default is inspect.Parameter.empty]

    @staticmethod
    def _fill(required, kw: dict) -> dict:
        # the old API has many optional-feature arguments without defaults (k_new, page_table,
        # descales...): None switches each of them off
        return {**{n: None for n in required if n not in kw}, **kw}

    @staticmethod
    def _varlen(packing) -> dict:
        """The varlen arguments (q/k/v then hold the sequences back to back; the lse is [H, total_q])."""
        return packing.flash_kwargs() if packing is not None else {}

    def forward(self, q, k, v, call: KernelCall):
        """``call`` in the kernel's terms (its causal flag and window bounds)."""
        (left, right), softcap, causal = call.window, float(call.softcap or 0.0), bool(call.causal)
        if self.api == "new":
            res = self.iface._flash_attn_forward(q=q, k=k, v=v, softmax_scale=call.scale, causal=causal,
                                                 window_size_left=left, window_size_right=right,
                                                 softcap=softcap, **self._varlen(call.packing))
        else:
            res = self.iface._flash_attn_forward(**self._fill(self._fwd_required, dict(
                q=q, k=k, v=v, softmax_scale=call.scale, causal=causal, window_size=(left, right),
                softcap=softcap, **self._varlen(call.packing))))
        if not isinstance(res, (tuple, list)) or len(res) < 2:
            raise RuntimeError("fa3: _flash_attn_forward did not return (out, softmax_lse, ...)")
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, call: KernelCall):
        (left, right), causal = call.window, bool(call.causal)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        common = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                      softmax_scale=call.scale, softcap=float(call.softcap or 0.0),
                      deterministic=bool(call.deterministic), **self._varlen(call.packing))
        if self.api == "new":
            self.iface._flash_attn_backward(**common, is_causal=causal,
                                            window_size_left=left, window_size_right=right)
            return dq, dk, dv      # written in place; the call returns softmax_d
        res = self.iface._flash_attn_backward(**self._fill(self._bwd_required, dict(
            common, causal=causal, window_size=(left, right))))
        if not isinstance(res, (tuple, list)) or len(res) != 4:
            raise RuntimeError("fa3: the old-API _flash_attn_backward did not return (dq, dk, dv, softmax_d)")
        return res[0], res[1], res[2]


def _load_kernel() -> _FA3Kernel:
    clash = op_clash()
    if clash:
        raise BackendUnavailable(f"fa3: {clash}")
    try:
        iface = importlib.import_module("flash_attn_interface")
    except ModuleNotFoundError as exc:
        if exc.name != "flash_attn_interface":
            raise BackendUnavailable(f"fa3: importing flash_attn_interface failed: {exc}") from exc
        try:
            iface = importlib.import_module("flash_attn_3.flash_attn_interface")
        except Exception as exc2:
            why = FlashAttn3Backend.availability().reason or "import failed"
            raise BackendUnavailable(f"fa3: cannot import flash_attn_interface nor "
                                     f"flash_attn_3.flash_attn_interface ({type(exc2).__name__}: {exc2}); "
                                     f"{why}") from exc2
    except Exception as exc:   # an operator registration that fails raises RuntimeError, not ImportError
        raise BackendUnavailable(f"fa3: importing flash_attn_interface failed ({type(exc).__name__}: {exc})") from exc
    for fn in (iface._flash_attn_forward, iface._flash_attn_backward):
        qual = foreign_op(fn)
        if qual is not None:
            raise BackendUnavailable(f"fa3: the operator {qual} now belongs to another package imported in this "
                                     "process (flash-attn >= 2.7 registers the same name); calling it would run "
                                     "that package's kernel")
    return _FA3Kernel(iface)


class FlashAttn3Backend(AttentionBackend):
    NAME = "fa3"
    DESCRIPTION = "FlashAttention-3 (hopper build): low-level forward/backward with lse, both API generations"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MAX = 256
    # Dk != Dv: the pairs FA3 takes are checked in not_supported_reasons (hopper/flash_api.cpp mha_fwd)
    SUPPORTS_DIFFERENT_V_DIM = True
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = False
    SUPPORTS_DROPOUT = False          # the kernel has no dropout
    SUPPORTS_GQA = True
    SUPPORTS_KEY_OFFSET = False       # windows take no position offset between ring blocks
    RETURNS_LSE = True
    HAS_BACKWARD = True
    SUPPORTS_DETERMINISTIC = True     # not for the head-dim-256 kernel: LIMITS
    VARLEN_KERNEL = True              # _flash_attn_forward/_backward with cu_seqlens_q/k
    MIN_COMPUTE_CAPABILITY = {"cuda": (9, 0)}
    MAX_COMPUTE_CAPABILITY = {"cuda": (9, 0)}
    REQUIRED_PACKAGES = (PACKAGE,)
    INPUT_LAYOUT = "last-dim-contiguous"
    POSITIONS = POSITIONS
    LIMITS = (
        Limit("deterministic backward is not available for head_dim={head_dim} (FA3 rounds it up to 256 and its "
              "deterministic backward covers head dims below 256)", uses=("deterministic",), head_dims=(193, 256),
              source=f"{SRC} hopper/flash_api.cpp mha_bwd (Deterministic backward not supported for hdim 256)"),
    )
    UPSTREAM_CHECKED = (
        ("old (window_size=(l, r)) and custom-op (window_size_left/right, is_causal) APIs; op namespace "
         "flash_attn:: from 2025-07-16 to 2025-08-19", f"{SRC} hopper/flash_attn_interface.py at 7a802796, "
                                                      "c7697bbf, fde4bc0c"),
        ("sm_90a kernels (plus sm80 unless disabled); window normalisation; deterministic backward below 256",
         f"{SRC} hopper/setup.py, hopper/flash_api.cpp"),
        ("a value head dim of its own: Q/K in (128, 192] with V in (96, 128], or Q/K <= 64 with V <= 512, Hopper "
         "only; the backward rounds max(Dk, Dv), at most 256", f"{SRC} hopper/flash_api.cpp mha_fwd, mha_bwd at "
                                                               "0251105a"),
        ("varlen through cu_seqlens_q/k and max_seqlen_q/k of the same functions; lse [H, total_q]; builds with "
         "FLASHATTENTION_DISABLE_VARLEN refuse it", f"{SRC} hopper/flash_api.cpp mha_fwd/mha_bwd at 7a802796 and "
                                                     "0251105a; hopper/flash_attn_interface.py"),
    )

    @classmethod
    def not_supported_reasons(cls, request):
        """The declared rules, and for Dk != Dv the pairs of ``mha_fwd`` (on head dims padded to
        8): Q/K in (128, 192] with V in (96, 128], or Q/K <= 64 with V <= 512, on Hopper only;
        ``mha_bwd`` rounds ``max(Dk, Dv)`` and takes at most 256 (so V <= 256 here), and its
        deterministic backward stays below a rounded 256."""
        reasons = super().not_supported_reasons(request)
        dk, dv = request.head_dim, request.v_dim
        if dk == dv:
            return reasons
        pk, pv = (-(-x // KERNEL_HEAD_DIM_MULTIPLE) * KERNEL_HEAD_DIM_MULTIPLE for x in (dk, dv))
        if not ((128 < pk <= 192 and 96 < pv <= 128) or (pk <= 64 and pv <= 256)):
            reasons.append(f"(head_dim, value head_dim)=({dk}, {dv}): FA3 takes a value head dim of its own only for "
                           "Q/K in (128, 192] with V in (96, 128], or Q/K <= 64 with V <= 256 (the backward's limit)")
        elif request.deterministic and request.needs_grad and max(pk, pv) > 192:
            reasons.append(f"deterministic backward is not available for head dims ({dk}, {dv}) (FA3 rounds the larger "
                           "up to 256)")
        return reasons

    @classmethod
    def availability(cls) -> Availability:
        if installed_version(PACKAGE) is None or importlib.util.find_spec(PACKAGE.module) is None:
            return Availability(False, f"{PACKAGE.dist} not installed ({BUILD_HINT})")
        return super().availability()

    @classmethod
    def extra_availability(cls, device_type, version):
        return op_clash()

    def _kernel(self) -> _FA3Kernel:
        kernel = getattr(self, "_loaded_kernel", None)
        if kernel is None:
            kernel = self._loaded_kernel = _load_kernel()
        return kernel

    @staticmethod
    def _kernel_call(q, k, call: KernelCall) -> KernelCall:
        """``call`` in the kernel's terms: its bottom-right causal flag and window (or refused)."""
        k_causal, left, right = kernel_window(POSITIONS, q.shape[1], k.shape[1], call.causal, call.window)
        return call.with_(causal=k_causal, window=(left, right))

    def kernel_forward(self, q, k, v, call: KernelCall):
        kernel = self._kernel()
        kcall = self._kernel_call(q, k, call)
        qp, kp, vp = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE) for x in (q, k, v))
        out, lse = kernel.forward(qp, kp, vp, kcall)
        return unpad(out, v.shape[-1]), normalize_lse(lse)

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        kernel = self._kernel()
        d = q.shape[-1]
        kcall = self._kernel_call(q, k, call)
        lse_k = lse_for_backward(lse).to(torch.float32).contiguous()
        dop, qp, kp, vp, op = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE)
                               for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        dq, dk, dv = kernel.backward(dop, qp, kp, vp, op, lse_k, kcall)
        return unpad(dq, d), unpad(dk, d), unpad(dv, v.shape[-1])

    # a build compiled with FLASHATTENTION_DISABLE_VARLEN (Dao-AILab/flash-attention hopper/flash_api.cpp
    # mha_fwd/mha_bwd since 7a802796: TORCH_CHECK(!is_varlen, ...)) refuses cu_seqlens: such a build is
    # served by one dense call per sequence (the base class), decided once on the first packed call
    NO_VARLEN_BUILD = "does not support varlen"

    def kernel_forward_packed(self, q, k, v, call: KernelCall):
        if getattr(self, "_dense_only", False):
            return super().kernel_forward_packed(q, k, v, call)
        kernel = self._kernel()
        qp, kp, vp = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE) for x in (q, k, v))
        try:
            out, lse = kernel.forward(qp, kp, vp, call)
        except RuntimeError as exc:
            if self.NO_VARLEN_BUILD not in str(exc):
                raise
            self._dense_only = True
            return self.kernel_forward_packed(q, k, v, call)
        return unpad(out, v.shape[-1]), normalize_lse(lse)

    def kernel_backward_packed(self, dout, q, k, v, out, lse, call: KernelCall):
        if getattr(self, "_dense_only", False):
            return super().kernel_backward_packed(dout, q, k, v, out, lse, call)
        kernel = self._kernel()
        d = q.shape[-1]
        lse_k = lse_for_backward(lse).to(torch.float32).contiguous()
        dop, qp, kp, vp, op = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE)
                               for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        dq, dk, dv = kernel.backward(dop, qp, kp, vp, op, lse_k, call)
        return unpad(dq, d), unpad(dk, d), unpad(dv, v.shape[-1])
