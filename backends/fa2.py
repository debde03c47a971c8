"""FlashAttention-2 (distribution ``flash-attn``, import ``flash_attn``).

The adapter drives the low-level ``flash_attn.flash_attn_interface._flash_attn_forward`` /
``_flash_attn_backward`` (the only calls that return the lse and take a given lse back),
across both API generations, chosen by the installed version compared *numerically*
(``"2.10.0"`` is newer than ``"2.6.3"``):

=============  ===========================================  ==================================
version        forward                                      backward
=============  ===========================================  ==================================
2.5.x          ``window_size=(l, r)``, no ``softcap``;       ``window_size=(l, r)``; returns
               returns ``(out, q, k, v, out_padded,          ``(dq, dk, dv, softmax_d)``
               softmax_lse, S_dmask, rng_state)``
2.6.x          as 2.5 plus ``softcap``                       as 2.5 plus ``softcap``
>= 2.7         ``window_size_left/right``; returns           writes ``dq/dk/dv`` in place,
               ``(out, softmax_lse, S_dmask, rng_state)``    returns ``softmax_d``
=============  ===========================================  ==================================

What the adapter adds so that the kernel keeps the contract of :mod:`usp_hal.dispatch.backend`:

* Head dims are zero-padded to a multiple of 8 before every call and sliced back
  (>= 2.7 rejects other head dims; zero columns add nothing to ``q.k`` and give zero
  output columns, so this is exact).  The scale is always passed explicitly.
* The kernel writes lse ``+inf`` for a row that sees no key; it is returned as ``-inf``.
  Before the backward, ``-inf`` rows become ``+inf`` again (:func:`lse_for_backward`),
  so they contribute nothing even when ``out``/``lse`` are the ring-merged ones.
* The kernel aligns causal/window/alibi positions to the bottom-right corner, the contract
  to the top-left (``POSITIONS``).  With ``Sq == Sk`` they agree.  Otherwise the window (and
  causal, folded into it) is shifted by ``Sk - Sq`` when the result is expressible, and
  refused when it is not, including the case the kernel itself breaks: ``mha_fwd`` treats a
  right bound ``>= Sk`` as unbounded, which drops a bound that still excludes keys when
  ``Sq >= Sk + 2``.  Alibi is refused for ``Sq != Sk``.
* On its causal path (``causal``, or a window ``(-1, 0)``) the kernel adds ALiBi as
  ``+slope * key_index`` instead of ``-slope * |query_index - key_index|``: the same
  softmax, but the lse is larger by ``slope * query_index``.  The adapter subtracts that
  from the lse it returns and adds it back before the backward.
* Per-version and per-device facts are declared in ``LIMITS`` (softcap from 2.6.0; the ROCm
  CK backend ignores softcap; the ROCm Triton backend ignores windows; architectures per
  version; backward head dims per architecture in 2.5.0-2.6.1).

Packed documents (``VARLEN_KERNEL``): the ring's packed calls go to
``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward``, with the same generations
(``window_size`` tuple before 2.7, ``softcap`` from 2.6, four return values and in-place
gradients from 2.7) plus one of their own: ``block_table`` has no default in 2.5.7-2.6.0
and is passed as None where the signature has it.  Their lse is ``[n_seq, H, max_seqlen_q]``
before 2.6.0 and ``[H, total_q]`` from 2.6.0; the adapter converts the old layout both ways.

Dropout is declared unsupported on purpose: the contract's backward receives no RNG state
from the forward, so the kernel could not replay the forward's dropout mask.

Two builds of the same Python package exist: the CUDA (or ROCm CK) build with the top-level
extension ``flash_attn_2_cuda``, and the Triton AMD build (installed with
``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE``, no extension at all), which
``flash_attn_interface.py`` imports as its kernel module when that variable is ``TRUE`` at
import time (v2.8.3 ``flash_attn/flash_attn_interface.py``: ``from .flash_attn_triton_amd
import interface_fa as flash_attn_gpu``).  Availability accepts either, names the one that
is missing, and the Triton AMD build's own limits (it takes the window and softcap and
ignores them) are declared for any device while the variable is set.

Builds of FlashAttention-3 from 2025-07-16 to 2025-08-19 register their ops under the same
names as flash-attn >= 2.7 (``flash_attn::_flash_attn_forward``); with both imported, the
later import replaces the earlier one's op.  The loader checks that the op it gets is its
own and reports the backend unavailable otherwise.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
from typing import Optional

import torch

from usp_hal.dispatch.backend import (
    AttentionBackend,
    BackendUnavailable,
    installed_version,
    lse_for_backward,
    normalize_lse,
    pad_head_dim,
    parse_version,
)
from usp_hal.dispatch.capabilities import Availability, KernelCall, Limit, Package, Positions, kernel_window

# ``module`` is the package itself: the Triton AMD build has no ``flash_attn_2_cuda`` (which
# of the two builds is present is checked by ``FlashAttn2Backend.availability``)
PACKAGE = Package(dist="flash-attn", module="flash_attn", min_version="2.5.0", extra="fa2", wheel=False)
SRC = "Dao-AILab/flash-attention"
CUDA_EXTENSION = "flash_attn_2_cuda"
#: the variable flash_attn_interface.py reads at import time to load the Triton AMD kernels
TRITON_AMD_ENV = ("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
TRITON_AMD_DIR = "flash_attn_triton_amd"

SOFTCAP_SINCE = "2.6.0"        # _flash_attn_forward/_backward gained ``softcap``
UNPADDED_LSE_SINCE = "2.6.0"   # varlen lse [H, total_q] (before: [n_seq, H, max_seqlen_q])
SPLIT_WINDOW_SINCE = "2.7.0"   # window_size_left/right, 4-tuple forward, in-place backward
KERNEL_HEAD_DIM_MULTIPLE = 8   # what the C++ kernels accept; the adapter pads to it

POSITIONS = Positions(alignment="bottom-right", causal_any_lengths=True, window="two-sided",
                      alibi_any_lengths=False, right_unbounded_from="seqlen_k",
                      source=f"{SRC} v2.8.3 csrc/flash_attn/flash_api.cpp mha_fwd "
                             "(if (window_size_right >= seqlen_k) window_size_right = -1)")


# ---------------------------------------------------------------------------- shared helpers
# (also used by the FlashAttention-3 adapter, whose kernel has the same conventions)

def default_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    """The caller's scale, or 1/sqrt(D) of the unpadded head dim (never the padded one)."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def unpad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x if x.shape[-1] == head_dim else x[..., :head_dim].contiguous()


_OP_RE = re.compile(r"""custom_op\(\s*["']([A-Za-z_][\w]*)::_flash_attn_forward["']""")


def custom_op_namespace(path: Optional[str]) -> Optional[str]:
    """The namespace a Python interface file registers ``_flash_attn_forward`` under (read as
    text: nothing is imported), or None."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            found = _OP_RE.search(fh.read())
    except OSError:
        return None
    return found.group(1) if found else None


def fa2_interface_path() -> Optional[str]:
    """``flash_attn/flash_attn_interface.py`` of the installed flash-attn, found without importing it."""
    spec = importlib.util.find_spec("flash_attn")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(loc, "flash_attn_interface.py")
        if os.path.isfile(path):
            return path
    return None


def triton_amd_requested() -> bool:
    """Whether flash_attn_interface.py would load its Triton AMD kernels in this process."""
    return os.environ.get(TRITON_AMD_ENV[0], "FALSE") == TRITON_AMD_ENV[1]


def build_missing(version: str) -> str:
    """Why the installed flash-attn cannot run in this process ('' when it can): the Triton
    AMD kernels when the variable asks for them, the CUDA extension otherwise.  Nothing is
    imported (find_spec on top-level names and file checks only)."""
    name, value = TRITON_AMD_ENV
    if triton_amd_requested():
        iface = fa2_interface_path()
        if iface is None or not os.path.isfile(os.path.join(os.path.dirname(iface), TRITON_AMD_DIR,
                                                            "interface_fa.py")):
            return (f"{name}={value} but flash-attn {version} has no Triton AMD backend "
                    f"(flash_attn/{TRITON_AMD_DIR}/interface_fa.py): unset {name} or install a build with it")
        if importlib.util.find_spec("triton") is None:
            return f"{name}={value}: flash-attn {version}'s Triton AMD backend needs triton, which is not installed"
        return ""
    if importlib.util.find_spec(CUDA_EXTENSION) is None:
        return (f"flash-attn {version} is installed without its CUDA extension {CUDA_EXTENSION}; a Triton AMD build "
                f"(installed with {name}={value}) runs only with {name}={value} set at run time too")
    return ""


def foreign_op(fn) -> Optional[str]:
    """For a ``torch.library`` custom op: its qualified name when the operator registered under
    that name now has another function's parameters (a later import replaced it), else None."""
    qual, init = getattr(fn, "_qualname", None), getattr(fn, "_init_fn", None)
    if qual is None or init is None:
        return None
    ns, _, name = qual.partition("::")
    try:
        schema = getattr(getattr(torch.ops, ns), name).default._schema
    except Exception:
        return qual
    return None if [a.name for a in schema.arguments] == list(inspect.signature(init).parameters) else qual


# ---------------------------------------------------------------------------- the kernel
class _FA2Kernel:
    """One imported ``flash_attn_interface`` and the call convention of its version."""

    def __init__(self, iface, version: str) -> None:
        self.iface = iface
        self.version = version
        self.triton_amd = False        # the Triton AMD kernels (set by the loader)
        parsed = parse_version(version)
        self.split_window = parsed >= parse_version(SPLIT_WINDOW_SINCE)
        self.has_softcap = parsed >= parse_version(SOFTCAP_SINCE)
        self.unpadded_lse = parsed >= parse_version(UNPADDED_LSE_SINCE)
        # 2.5.7-2.6.0: the varlen forward's ``block_table`` has no default (read once, not per call)
        self.varlen_block_table = "block_table" in (signature_parameters(iface._flash_attn_varlen_forward) or {})

    def _common(self, kw: dict, call: KernelCall) -> dict:
        left, right = call.window
        if self.split_window:
            kw.update(window_size_left=left, window_size_right=right)
        else:
            kw["window_size"] = (left, right)
        if self.has_softcap:
            kw["softcap"] = float(call.softcap or 0.0)
        kw["causal"] = bool(call.causal)
        return kw

    @staticmethod
    def _varlen(kw: dict, packing, block_table: bool) -> dict:
        """The varlen arguments (``block_table`` None, no paged KV, where the forward requires it)."""
        kw.update(cu_seqlens_q=packing.cu_q, cu_seqlens_k=packing.cu_k, max_seqlen_q=packing.max_q,
                  max_seqlen_k=packing.max_k)
        if block_table:
            kw["block_table"] = None
        return kw

    def forward(self, q, k, v, call: KernelCall):
        """``_flash_attn_forward``, or with ``call.packing`` ``_flash_attn_varlen_forward`` (q/k/v
        then hold the sequences back to back): (out, lse as this version lays it out).  ``call``
        is in the kernel's terms (its causal flag and window bounds, its slopes)."""
        packing = call.packing
        name = "_flash_attn_varlen_forward" if packing is not None else "_flash_attn_forward"
        fn = getattr(self.iface, name)
        kw = self._common(dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=call.scale,
                               alibi_slopes=call.alibi_slopes, return_softmax=False), call)
        res = fn(**(self._varlen(kw, packing, self.varlen_block_table) if packing is not None else kw))
        want = 4 if self.split_window else 8
        if len(res) != want:
            raise RuntimeError(f"fa2: flash-attn {self.version} {name} returned {len(res)} "
                               f"values, expected {want} for this version")
        # <= 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
        return (res[0], res[1]) if self.split_window else (res[0], res[5])

    def backward(self, dout, q, k, v, out, lse, call: KernelCall):
        packing = call.packing
        name = "_flash_attn_varlen_backward" if packing is not None else "_flash_attn_backward"
        fn = getattr(self.iface, name)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = self._common(dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                               dropout_p=0.0, softmax_scale=call.scale, alibi_slopes=call.alibi_slopes,
                               deterministic=bool(call.deterministic), rng_state=None), call)
        res = fn(**(self._varlen(kw, packing, False) if packing is not None else kw))
        if self.split_window:
            return dq, dk, dv          # written in place; ``res`` is softmax_d
        if not isinstance(res, (tuple, list)) or len(res) != 4:
            raise RuntimeError(f"fa2: flash-attn {self.version} {name} did not return (dq, dk, dv, softmax_d)")
        return res[0], res[1], res[2]


def signature_parameters(fn) -> Optional[dict]:
    """Parameters of ``fn``, looking through a ``torch.library`` custom op to its Python
    function (also used by the FlashAttention-3 adapter); None when they cannot be read."""
    try:
        return dict(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    except (TypeError, ValueError):
        return None


def padded_lse_to_packed(lse: torch.Tensor, packing) -> torch.Tensor:
    """flash-attn < 2.6 varlen lse ``[n_seq, H, max_q]`` -> the packed ``[H, Tq]``."""
    seq, pos = _row_coordinates(packing, lse.device)
    return lse[seq, :, pos].t().contiguous()


def packed_lse_to_padded(lse: torch.Tensor, packing) -> torch.Tensor:
    """The packed ``[H, Tq]`` -> flash-attn < 2.6's ``[n_seq, H, max_q]`` (padding rows 0)."""
    seq, pos = _row_coordinates(packing, lse.device)
    padded = lse.new_zeros(len(packing.q_lens), lse.shape[0], packing.max_q)
    padded[seq, :, pos] = lse.t()
    return padded


def _row_coordinates(packing, device):
    """(sequence index, position in it) of every packed query row, on ``device`` (made once per
    packing: the ring reuses its packings call after call)."""
    key = ("fa2-rows", str(device))
    got = packing.cache.get(key)
    if got is None:
        seq = torch.repeat_interleave(torch.arange(len(packing.q_lens), device=device),
                                      torch.tensor(packing.q_lens, device=device), output_size=packing.total_q)
        starts = packing.cu_q[:-1].to(device=device, dtype=torch.long)
        got = packing.cache[key] = (seq, torch.arange(packing.total_q, device=device) - starts[seq])
    return got


def _load_kernel() -> _FA2Kernel:
    try:
        iface = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as exc:
        why = FlashAttn2Backend.availability().reason or "import failed"
        raise BackendUnavailable(f"fa2: cannot import flash_attn.flash_attn_interface "
                                 f"({type(exc).__name__}: {exc}); {why}") from exc
    version = installed_version(PACKAGE)
    if version is None:
        version = getattr(importlib.import_module("flash_attn"), "__version__", None)
    if version is None:
        raise BackendUnavailable("fa2: cannot tell which flash-attn version is installed (no package "
                                 "metadata, no flash_attn.__version__), so its API generation is unknown")
    if parse_version(version) < parse_version(PACKAGE.min_version or "0"):
        raise BackendUnavailable(f"fa2: flash-attn {version} too old (needs >= {PACKAGE.min_version})")
    for fn in (iface._flash_attn_forward, iface._flash_attn_backward, iface._flash_attn_varlen_forward,
               iface._flash_attn_varlen_backward):
        qual = foreign_op(fn)
        if qual is not None:
            raise BackendUnavailable(
                f"fa2: the operator {qual} now belongs to another package imported in this process (a "
                "FlashAttention-3 build from 2025-07-16..2025-08-19 registers the same name); calling it "
                "would run that package's kernel: do not import both, or rebuild FlashAttention-3")
    kernel = _FA2Kernel(iface, version)
    gpu = getattr(iface, "flash_attn_gpu", None) or getattr(iface, "flash_attn_cuda", None)
    kernel.triton_amd = TRITON_AMD_DIR in getattr(gpu, "__name__", "")
    return kernel


def _causal_path(causal: bool, left: int, right: int, sk: int) -> bool:
    """Whether the kernel takes its causal code path (its own window normalisation)."""
    if causal:
        right = 0
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    return left < 0 and right == 0


def _alibi_lse_shift(slopes, q, k_causal, left, right, sk):
    """``slope * query_index`` [B|1, H, Sq] when the kernel's causal ALiBi path applies."""
    if slopes is None or not _causal_path(k_causal, left, right, sk):
        return None
    b, sq, h, _ = q.shape
    rows = torch.arange(sq, device=slopes.device, dtype=torch.float32)
    s = slopes.view(-1, h, 1)
    return s * rows.view(1, 1, sq)


def _slopes(alibi_slopes, q, per_batch: bool = False):
    """The slopes as the kernel takes them: float32, contiguous; ``per_batch`` ``[B, H]`` (the
    Triton AMD kernels assert a 2-D ``[batch, nheads]`` tensor in utils.py MetaData.need_alibi)."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
    if per_batch and slopes.dim() == 1:
        slopes = slopes.unsqueeze(0).expand(q.shape[0], -1)
    return slopes.contiguous()


# ---------------------------------------------------------------------------- the backend
_V = f"{SRC} "
LIMITS = (
    Limit("softcap needs flash-attn >= 2.6.0 (installed: {version})", uses=("softcap",), version="<2.6.0",
          source=_V + "v2.6.0 flash_attn/flash_attn_interface.py _flash_attn_forward (softcap added)"),
    Limit("softcap on rocm: flash-attn's CK backend takes softcap and ignores it", uses=("softcap",),
          devices=("rocm",), source=_V + "v2.8.3 csrc/flash_attn_ck/mha_fwd.cpp mha_fwd, mha_bwd.cpp mha_bwd "
                                        "(softcap parameter unused)"),
    Limit("sliding window with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE: flash-attn's Triton AMD "
          "backend takes the window and ignores it; unset the variable (CK or CUDA build) or use attn_type='sdpa'",
          uses=("window",), env=TRITON_AMD_ENV,
          source=_V + "v2.8.3 flash_attn/flash_attn_triton_amd/interface_fa.py fwd/bwd/varlen_fwd/varlen_bwd "
                      "(window unused); seen under the Triton interpreter"),
    Limit("softcap with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE: flash-attn's Triton AMD backend takes softcap "
          "and ignores it; use a CUDA build of flash-attn for softcap", uses=("softcap",), env=TRITON_AMD_ENV,
          source=_V + "v2.8.3 flash_attn/flash_attn_triton_amd/interface_fa.py fwd/bwd/varlen_fwd/varlen_bwd "
                      "(softcap unused)"),
    Limit("flash-attn {version} runs on sm8x and sm90 only (found {cc}); sm100/sm120 need flash-attn >= 2.7.3",
          devices=("cuda",), version="<2.7.3", archs=("sm8x", "sm90"),
          source=_V + "v2.7.2 csrc/flash_attn/flash_api.cpp mha_fwd (is_sm8x || is_sm90)"),
    Limit("backward with head_dim {head_dim} (> 192 after padding to 8) needs sm80 or sm90 in flash-attn "
          "{version} (found {cc})", uses=("backward",), devices=("cuda",), version=">=2.5.0,<2.5.5",
          head_dims=(193, 256), pad_to=KERNEL_HEAD_DIM_MULTIPLE, archs=("sm80", "sm90"),
          source=_V + "v2.5.0 csrc/flash_attn/flash_api.cpp mha_bwd (head_size > 192)"),
    Limit("backward with head_dim {head_dim} (193..224 after padding to 8) needs sm80 or sm90 in flash-attn "
          "{version} (found {cc})", uses=("backward",), devices=("cuda",), version=">=2.5.5,<2.6.2",
          head_dims=(193, 224), pad_to=KERNEL_HEAD_DIM_MULTIPLE, archs=("sm80", "sm90"),
          source=_V + "v2.6.1 csrc/flash_attn/flash_api.cpp mha_bwd (head_size > 192 && head_size <= 224)"),
)


class FlashAttn2Backend(AttentionBackend):
    NAME = "fa2"
    DESCRIPTION = "FlashAttention-2 (flash-attn): low-level forward/backward with lse, both API generations"
    SUPPORTED_DEVICES = frozenset({"cuda", "rocm"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MAX = 256
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True           # per version and device: LIMITS
    SUPPORTS_ALIBI = True
    SUPPORTS_DROPOUT = False          # the contract carries no RNG state into the backward
    SUPPORTS_GQA = True
    SUPPORTS_KEY_OFFSET = False       # window/alibi take no position offset between blocks
    RETURNS_LSE = True
    HAS_BACKWARD = True
    SUPPORTS_DETERMINISTIC = True     # ``deterministic`` is passed to the backward kernel
    VARLEN_KERNEL = True              # _flash_attn_varlen_forward/_backward
    MIN_COMPUTE_CAPABILITY = {"cuda": (8, 0)}
    REQUIRED_PACKAGES = (PACKAGE,)
    INPUT_LAYOUT = "last-dim-contiguous"
    POSITIONS = POSITIONS
    LIMITS = LIMITS
    UPSTREAM_CHECKED = (
        ("API generations, return arity, softcap from 2.6.0, head dims padded by the caller from 2.7",
         f"{SRC} v2.5.9, v2.6.3, v2.7.0, v2.8.3 flash_attn/flash_attn_interface.py"),
        ("window normalisation (right >= Sk -> unbounded), sm8x/sm90 check before 2.7.3, backward head dims "
         "per architecture", f"{SRC} v2.5.0-v2.8.3 csrc/flash_attn/flash_api.cpp mha_fwd/mha_bwd"),
        ("ROCm: CK ignores softcap; Triton AMD ignores window/softcap",
         f"{SRC} v2.8.3 csrc/flash_attn_ck/, flash_attn/flash_attn_triton_amd/interface_fa.py"),
        ("Triton AMD build: no flash_attn_2_cuda, loaded when FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE at import; "
         "varlen lse [total_q, H] (its backward reads it so too); alibi -slope*|distance| on every path (no "
         "causal-path shift)", f"{SRC} v2.8.3 flash_attn/flash_attn_interface.py (import switch), "
         "flash_attn_triton_amd/fwd_prefill.py attention_prefill_forward_triton_impl, bwd_prefill_split.py, "
         "utils.py compute_alibi_block"),
        ("varlen entry points per generation (block_table without default in 2.5.7-2.6.0, softcap from 2.6, "
         "window_size_left/right and 4 return values from 2.7)",
         f"{SRC} v2.5.0, v2.5.7, v2.5.9, v2.6.0, v2.6.3, v2.7.0, v2.8.3 flash_attn/flash_attn_interface.py "
         "_flash_attn_varlen_forward/_flash_attn_varlen_backward"),
        ("varlen lse [n_seq, H, max_seqlen_q] before 2.6.0, [H, total_q] from 2.6.0",
         f"{SRC} v2.5.9, v2.6.0 csrc/flash_attn/flash_api.cpp mha_varlen_fwd (softmax_lse = torch::empty(...))"),
    )

    @classmethod
    def not_supported_reasons(cls, request) -> list:
        reasons = super().not_supported_reasons(request)
        sq, sk = request.seqlen_q, request.seqlen_k
        if (triton_amd_requested() and sq is not None and sk is not None and sq != sk
                and (request.causal or request.has_window)):
            # the contract's top-left mask reaches the kernel as a bottom-right window, which the
            # Triton AMD kernels ignore (seen under the Triton interpreter: causal 20x12 came back unmasked)
            reasons.append(f"causal/window with Sq={sq} != Sk={sk} and {'='.join(TRITON_AMD_ENV)}: the kernel would "
                           "need a window, which flash-attn's Triton AMD backend takes and ignores; use equal "
                           "lengths, or attn_type='sdpa'")
        return reasons

    @classmethod
    def availability(cls):
        # which build is present comes first: on a machine without the device, "the CUDA
        # extension is missing" says more than "no cuda device" for a Triton AMD install
        version = installed_version(PACKAGE)
        if (version is not None and importlib.util.find_spec(PACKAGE.module) is not None
                and parse_version(version) >= parse_version(PACKAGE.min_version or "0")):
            why = build_missing(version)
            if why:
                return Availability(False, why, version)
        return super().availability()

    #: what tests/real/ runs on the real package under the Triton interpreter (docs)
    INTERPRETER_CHECKED = (
        ("2.8.3 Triton AMD build, fp16: forward and backward through the adapter (head dims 32-128, GQA/MQA, "
         "causal, Sq != Sk without masks, alibi, deterministic), the varlen entry points, and LongContextAttention "
         "(1 rank, Ulysses-2, Ring-2 basic and zigzag); window/softcap and causal with Sq != Sk refused",
         "bf16 (the interpreter computes a bf16 tl.dot on the raw storage), the CUDA and CK builds, other versions, "
         "AMD hardware"),
    )

    def _kernel(self) -> _FA2Kernel:
        kernel = getattr(self, "_loaded_kernel", None)
        if kernel is None:
            kernel = self._loaded_kernel = _load_kernel()
        if kernel.triton_amd != triton_amd_requested():
            # the declared Triton AMD limits follow the variable; the kernel was chosen at import
            name, value = TRITON_AMD_ENV
            built = "its Triton AMD kernels" if kernel.triton_amd else f"the {CUDA_EXTENSION} extension"
            raise BackendUnavailable(f"fa2: flash_attn_interface was imported with {built}, but {name} is now "
                                     f"{'not ' if kernel.triton_amd else ''}{value}: the declared limits would not "
                                     f"match the kernel; set {name} once, before flash_attn is imported")
        return kernel

    def _kernel_call(self, kernel: _FA2Kernel, q, k, call: KernelCall) -> KernelCall:
        """``call`` in the kernel's terms: the contract's top-left masks as its bottom-right causal
        flag and window (refused where they cannot be expressed), its slopes' layout."""
        k_causal, left, right = kernel_window(POSITIONS, q.shape[1], k.shape[1], call.causal, call.window,
                                              call.alibi_slopes is not None)
        return call.with_(causal=k_causal, window=(left, right),
                          alibi_slopes=_slopes(call.alibi_slopes, q, per_batch=kernel.triton_amd))

    def kernel_forward(self, q, k, v, call: KernelCall):
        kernel = self._kernel()
        sk, d = k.shape[1], q.shape[-1]
        kcall = self._kernel_call(kernel, q, k, call)
        k_causal, (left, right), slopes = kcall.causal, kcall.window, kcall.alibi_slopes
        qp, kp, vp = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE) for x in (q, k, v))
        out, lse = kernel.forward(qp, kp, vp, kcall)
        lse = normalize_lse(lse)
        # the Triton AMD kernels add -slope * |distance| on every path: no causal-path shift there
        shift = None if kernel.triton_amd else _alibi_lse_shift(slopes, q, k_causal, left, right, sk)
        if shift is not None:
            lse = lse - shift
        return unpad(out, d), lse

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        kernel = self._kernel()
        sk, d = k.shape[1], q.shape[-1]
        kcall = self._kernel_call(kernel, q, k, call)
        k_causal, (left, right), slopes = kcall.causal, kcall.window, kcall.alibi_slopes
        lse_k = lse_for_backward(lse).to(torch.float32)
        shift = None if kernel.triton_amd else _alibi_lse_shift(slopes, q, k_causal, left, right, sk)
        if shift is not None:
            lse_k = lse_k + shift
        dop, qp, kp, vp, op = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE)
                               for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        dq, dk, dv = kernel.backward(dop, qp, kp, vp, op, lse_k.contiguous(), kcall)
        return unpad(dq, d), unpad(dk, d), unpad(dv, d)

    def kernel_forward_packed(self, q, k, v, call: KernelCall):
        # every sequence is a square with key offset 0 when causal or windowed, where the kernel's
        # bottom-right masks are the contract's
        kernel = self._kernel()
        d, packing = q.shape[-1], call.packing
        qp, kp, vp = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE) for x in (q, k, v))
        out, lse = kernel.forward(qp, kp, vp, call)
        if kernel.triton_amd:
            lse = lse.t()          # the Triton AMD varlen lse is [total_q, H]
        elif not kernel.unpadded_lse:
            lse = padded_lse_to_packed(lse, packing)
        return unpad(out, d), normalize_lse(lse)

    def kernel_backward_packed(self, dout, q, k, v, out, lse, call: KernelCall):
        kernel = self._kernel()
        d, packing = q.shape[-1], call.packing
        lse_k = lse_for_backward(lse).to(torch.float32).contiguous()
        if kernel.triton_amd:
            lse_k = lse_k.t().contiguous()      # its varlen backward reads the lse as [total_q, H]
        elif not kernel.unpadded_lse:
            lse_k = packed_lse_to_padded(lse_k, packing)
        dop, qp, kp, vp, op = (pad_head_dim(x, KERNEL_HEAD_DIM_MULTIPLE)
                               for x in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        dq, dk, dv = kernel.backward(dop, qp, kp, vp, op, lse_k, call)
        return unpad(dq, d), unpad(dk, d), unpad(dv, d)
