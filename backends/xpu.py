"""Intel XPU: torch's own flash-attention op on XPU, forward and backward.

Kernel entry points (torch >= 2.10 XPU builds; torch-xpu-ops "SYCL-TLA" flash kernels)::

    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v [B, H, S, D], dropout_p,
        is_causal, return_debug_mask, *, scale)
        -> (out, logsumexp [B, H, Sq] fp32, cum_seq_q, cum_seq_k, max_q, max_k,
            rng_state, unused, debug_attn_mask)
    torch.ops.aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out,
        logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        philox_seed, philox_offset, *, scale) -> (dq, dk, dv)

What the adapter does to meet the contract (facts from intel/torch-xpu-ops
``src/ATen/native/transformers/xpu/flash_attn/sycltla/``, branches release/2.10 to 2.14):

* Layout: the contract's ``[B, S, H, D]`` is passed as transposed ``[B, H, S, D]`` views of
  contiguous tensors (the forward accepts BSHD or BHSD memory only).
* Head dims: up to torch 2.12 the forward has kernels for 64, 96, 128 and 192 only ("only
  support headdim 64,96,128,192") and the backward for 64..256, so Q/K/V are zero-padded to
  the next of 64/96/128/192 (exact, with the scale passed explicitly) and the results
  sliced back; head dims above 192 are refused there.  From 2.13 both directions take any
  head dim up to 256 (the kernels round up themselves).
* Device models: PVC, PVC-VG and BMG-G21 up to 2.11; BMG-G31 from 2.12.  Other Intel GPUs
  are refused by the op and here.
* GQA is native in both ops (the backward sums dk/dv over the group itself); if a
  release hands back per-query-head dk/dv the adapter sums them.
* lse is natural log; the kernel writes 0 for a fully masked row, but no call this
  adapter accepts has one (no window; causal only with ``Sq == Sk``, because the kernel
  aligns causal bottom-right).  The backward gets the contract's (possibly global) lse
  with ``-inf`` rows turned into ``+inf`` so they contribute nothing.
* The dense ops leave ``cum_seq_q/k`` undefined (``None`` from Python) and, without
  dropout, ignore the RNG state: the backward passes zero placeholders as
  ``philox_seed/offset`` (the contract carries no RNG state, hence no dropout).
* No window, softcap or alibi in these ops: refused, never dropped.  The kernels also
  need a torch build with ``USE_SYCLTLA``; the op raises otherwise.
* Before torch 2.10 there is no XPU flash kernel at all (torch-xpu-ops has no
  ``flash_attn`` before release/2.10; the oneDNN SDPA of those builds is not used here).

The op lookup goes through :func:`flash_ops` so a contract test can substitute a CPU
stand-in with the same signatures.
"""
from __future__ import annotations

import torch

from usp_hal.dispatch import platform as _platform
from usp_hal.dispatch.backend import AttentionBackend, lse_for_backward, normalize_lse, pad_to, parse_version
from usp_hal.dispatch.capabilities import Availability, KernelCall, Limit, Positions

MIN_TORCH = "2.10"
SRC = "intel/torch-xpu-ops"
# forward head dims of the SYCL-TLA kernels before torch 2.13 (2.13+: any head dim up to 256)
FORWARD_HEAD_DIMS_BEFORE_2_13 = (64, 96, 128, 192)
ANY_HEAD_DIM_FROM = "2.13"
MODELS_2_10 = ("intel_gpu_pvc", "intel_gpu_pvc_vg", "intel_gpu_bmg_g21")
MODELS_2_12 = MODELS_2_10 + ("intel_gpu_bmg_g31",)


def flash_ops():
    """``(forward, backward)``: the aten flash-attention ops, looked up at call time."""
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward


def torch_version() -> str:
    return _platform.torch_version()


def kernel_head_dim(head_dim: int, version: "str | None" = None) -> int:
    """The head dim the forward kernel runs with for this torch version (after padding)."""
    version = version or torch_version()
    if parse_version(version) >= parse_version(ANY_HEAD_DIM_FROM):
        if head_dim > 256:
            raise ValueError(f"xpu: head_dim={head_dim} > 256 is not supported")
        return head_dim
    for size in FORWARD_HEAD_DIMS_BEFORE_2_13:
        if head_dim <= size:
            return size
    raise ValueError(f"xpu: head_dim={head_dim} > {FORWARD_HEAD_DIMS_BEFORE_2_13[-1]} is not supported by "
                     f"torch {version} (its XPU forward has head dims {FORWARD_HEAD_DIMS_BEFORE_2_13})")


LIMITS = (
    Limit("torch {torch} has no XPU flash-attention kernel: intel/torch-xpu-ops ships its SYCL-TLA flash "
          "kernels from torch 2.10 on (install torch >= 2.10 for XPU)", devices=("xpu",), torch=f"<{MIN_TORCH}",
          source=f"{SRC} release/2.9 vs release/2.10 (src/ATen/native/transformers/xpu/flash_attn/)"),
    Limit("head_dim={head_dim}: torch {torch}'s XPU flash forward has kernels for head dims 64, 96, 128 and "
          "192 only (256 arrives in torch 2.13)", devices=("xpu",), torch=f">={MIN_TORCH},<{ANY_HEAD_DIM_FROM}",
          head_dims=(193, 256),
          source=f"{SRC} release/2.10-2.12 sycltla/mha_fwd.cpp (only support headdim 64,96,128,192)"),
    Limit("device model {model}: the XPU flash kernels of torch {torch} run on " + ", ".join(MODELS_2_10) + " only",
          devices=("xpu",), torch=f">={MIN_TORCH},<2.12", models=MODELS_2_10,
          source=f"{SRC} release/2.10-2.11 sycltla/mha_fwd.cpp, mha_bwd.cpp (supported_architectures)"),
    Limit("device model {model}: the XPU flash kernels of torch {torch} run on " + ", ".join(MODELS_2_12) + " only",
          devices=("xpu",), torch=">=2.12", models=MODELS_2_12,
          source=f"{SRC} release/2.12-2.14 sycltla/mha_fwd.cpp, mha_bwd.cpp (supported_architectures)"),
)


class XPUBackend(AttentionBackend):
    NAME = "xpu"
    DESCRIPTION = "torch flash attention on Intel XPU (aten._scaled_dot_product_flash_attention, torch >= 2.10)"
    SUPPORTED_DEVICES = frozenset({"xpu"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MIN = 1
    HEAD_DIM_MAX = 256
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = False
    SUPPORTS_SOFTCAP = False
    SUPPORTS_ALIBI = False
    SUPPORTS_DROPOUT = False
    SUPPORTS_GQA = True
    RETURNS_LSE = True
    HAS_BACKWARD = True
    IS_DETERMINISTIC = False        # dq is accumulated with atomics
    INPUT_LAYOUT = "contiguous"
    POSITIONS = Positions(alignment="bottom-right", causal_any_lengths=False, window="none",
                          source=f"{SRC} sycltla/mha_fwd.cpp (lower-right causal mask when seqlen_qo > seqlen_kv)")
    LIMITS = LIMITS
    UPSTREAM_CHECKED = (
        ("forward head dims per torch version, device models per version, BSHD/BHSD layouts, lse 0 for "
         "masked rows, bottom-right causal", f"{SRC} release/2.10-2.14 sycltla/mha_fwd.cpp, mha_bwd.cpp"),
        ("backward head dims 64..256", f"{SRC} release/2.10-2.12 sycltla/mha_bwd.cpp (unsupported head dimension)"),
        ("device architecture ids", "intel/llvm sycl/include/sycl/ext/oneapi/experimental/device_architecture.def"),
    )

    @classmethod
    def availability(cls) -> Availability:
        avail = super().availability()
        if not avail.ok and "xpu" not in _platform.available_device_types() and not torch.version.xpu:
            return Availability(False, f"{avail.reason} (this torch build has no XPU support: install an "
                                       f"XPU build of torch >= {MIN_TORCH})", avail.version)
        return avail

    def kernel_forward(self, q, k, v, call: KernelCall):
        d = q.shape[-1]
        target = kernel_head_dim(d)
        qt, kt, vt = (pad_to(x, target).transpose(1, 2) for x in (q, k, v))
        fwd, _ = flash_ops()
        res = fwd(qt, kt, vt, 0.0, bool(call.causal), False, scale=call.scale)
        out = res[0].transpose(1, 2)[..., :d].contiguous()
        return out, normalize_lse(res[1])

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        d = q.shape[-1]
        sq, sk, hkv = q.shape[1], k.shape[1], k.shape[2]
        target = kernel_head_dim(d)
        qt, kt, vt, ot, dot = (pad_to(x.to(q.dtype), target).contiguous().transpose(1, 2)
                               for x in (q, k, v, out, dout))
        lse = lse_for_backward(lse).float().contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        _, bwd = flash_ops()
        dq, dk, dv = bwd(dot, qt, kt, vt, ot, lse, None, None, sq, sk, 0.0, bool(call.causal), seed, offset,
                         scale=call.scale)[:3]
        dk, dv = _sum_groups(dk, hkv), _sum_groups(dv, hkv)
        return tuple(g.transpose(1, 2)[..., :d].contiguous() for g in (dq, dk, dv))


def _sum_groups(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, H, S, D] per-query-head gradient -> [B, Hkv, S, D] (no-op when already Hkv heads)."""
    b, h, s, d = g.shape
    return g if h == hkv else g.reshape(b, hkv, h // hkv, s, d).sum(2)
