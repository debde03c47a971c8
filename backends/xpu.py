"""Intel XPU: torch's own flash-attention op on XPU, forward and backward.

Kernel entry points (torch >= 2.10 XPU builds; torch-xpu-ops "SYCL-TLA" flash kernels)::

    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v [B, H, S, D], dropout_p,
        is_causal, return_debug_mask, *, scale)
        -> (out, logsumexp [B, H, Sq] fp32, cum_seq_q, cum_seq_k, max_q, max_k,
            rng_state, unused, debug_attn_mask)
    torch.ops.aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out,
        logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        philox_seed, philox_offset, *, scale) -> (dq, dk, dv)

What the adapter does to meet the contract:

* Layout: the contract's ``[B, S, H, D]`` is passed as transposed ``[B, H, S, D]`` views.
* Head dims: the backward kernels exist for 64, 96, 128, 192 and 256 only, so Q/K/V are
  zero-padded to the next of those (exact, with the scale passed explicitly) for both
  directions and the results sliced back.
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
  need a torch build with ``USE_SYCLTLA`` and a PVC or BMG GPU; the op raises otherwise.

The op lookup goes through :func:`flash_ops` so a contract test can substitute a CPU
stand-in with the same signatures.
"""
from __future__ import annotations

import torch

from usp_hal import platform as _platform
from usp_hal.backend import AttentionBackend, lse_for_backward, normalize_lse, pad_head_dim, parse_version
from usp_hal.capabilities import Availability

MIN_TORCH = "2.10"
KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)


def flash_ops():
    """``(forward, backward)``: the aten flash-attention ops, looked up at call time."""
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward


def torch_version() -> str:
    return torch.__version__


def kernel_head_dim(head_dim: int) -> int:
    for size in KERNEL_HEAD_DIMS:
        if head_dim <= size:
            return size
    raise ValueError(f"xpu: head_dim={head_dim} > {KERNEL_HEAD_DIMS[-1]} is not supported")


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

    @classmethod
    def _torch_reason(cls) -> str:
        found = torch_version()
        if parse_version(found) < parse_version(MIN_TORCH):
            return (f"torch {found} has no XPU flash-attention op with an lse (torch >= {MIN_TORCH} needed; "
                    "older torch needed intel-extension-for-pytorch for XPU, which is discontinued)")
        return ""

    @classmethod
    def extra_availability(cls, device_type, version):
        return cls._torch_reason()

    @classmethod
    def availability(cls) -> Availability:
        avail = super().availability()
        if not avail.ok and "xpu" not in _platform.available_device_types() and not torch.version.xpu:
            return Availability(False, f"{avail.reason} (this torch build has no XPU support: install an "
                                       f"XPU build of torch >= {MIN_TORCH})", avail.version)
        return avail

    @staticmethod
    def _check_call(q, k, causal, window, softcap, alibi_slopes, dropout_p):
        if tuple(window) != (-1, -1) or softcap or alibi_slopes is not None or dropout_p:
            raise NotImplementedError(
                "xpu: the XPU flash op has no window, softcap, alibi or dropout "
                f"(got window={tuple(window)}, softcap={softcap}, alibi={alibi_slopes is not None}, "
                f"dropout_p={dropout_p})")
        if causal and q.shape[1] != k.shape[1]:
            raise ValueError(f"xpu: causal attention needs Sq == Sk (got Sq={q.shape[1]}, Sk={k.shape[1]}); "
                             "the XPU kernel aligns causal bottom-right")

    def forward(self, q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, key_offset=0):
        self._check_call(q, k, causal, window, softcap, alibi_slopes, dropout_p)
        d = q.shape[-1]
        scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
        target = kernel_head_dim(d)
        qt, kt, vt = (pad_head_dim(x, target).transpose(1, 2) for x in (q, k, v))
        fwd, _ = flash_ops()
        res = fwd(qt, kt, vt, 0.0, bool(causal), False, scale=scale)
        out = res[0].transpose(1, 2)[..., :d].contiguous()
        return out, normalize_lse(res[1])

    def backward(self, dout, q, k, v, out, lse, *, softmax_scale, causal=False, window=(-1, -1),
                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, key_offset=0):
        self._check_call(q, k, causal, window, softcap, alibi_slopes, dropout_p)
        d = q.shape[-1]
        sq, sk, hkv = q.shape[1], k.shape[1], k.shape[2]
        scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
        target = kernel_head_dim(d)
        qt, kt, vt, ot, dot = (pad_head_dim(x.to(q.dtype), target).transpose(1, 2)
                               for x in (q, k, v, out, dout))
        lse = lse_for_backward(lse).float().contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        _, bwd = flash_ops()
        dq, dk, dv = bwd(dot, qt, kt, vt, ot, lse, None, None, sq, sk, 0.0, bool(causal), seed, offset,
                         scale=scale)[:3]
        dk, dv = _sum_groups(dk, hkv), _sum_groups(dv, hkv)
        return tuple(g.transpose(1, 2)[..., :d].contiguous() for g in (dq, dk, dv))


def _sum_groups(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, H, S, D] per-query-head gradient -> [B, Hkv, S, D] (no-op when already Hkv heads)."""
    b, h, s, d = g.shape
    return g if h == hkv else g.view(b, hkv, h // hkv, s, d).sum(2)
