"""Stand-in sources for flash-attn 2.x and FlashAttention-3 (contract tests only).

Each stand-in is installed under the real import paths with the real package metadata
(see :mod:`tests.contract.standin`) and keeps the real Python signatures of its version:

* FA2: ``flash_attn/__init__.py`` (``__version__``), ``flash_attn/flash_attn_interface.py``
  (``_flash_attn_forward`` / ``_flash_attn_backward`` of that version; ``torch.library``
  custom ops from 2.7 on) and the top-level extension ``flash_attn_2_cuda`` (``fwd`` /
  ``bwd`` with the C++ argument order and return lists).
* FA3: the top-level ``flash_attn_interface.py`` (old or new API) and the package
  ``flash_attn_3`` (``__init__`` and the ``_C`` extension stand-in).

The "kernels" compute attention on CPU tensors in float32 and copy the real packages'
behaviour, each quirk with the upstream source it was read from (at the line that models
it): fp16/bf16 only; positions aligned to the bottom-right corner (causal, window, alibi);
FA2 treats a right bound ``>= Sk`` as unbounded, FA3 one ``>= Sq - 1``; FA2's causal ALiBi
path adds ``slope * key_index``; lse ``+inf`` (FA2) / ``-inf`` (FA3) for a row with no key
and ``+inf`` when there are no keys at all; head dims that are not a multiple of 8 rejected
by the FA2 >= 2.7 and FA3 forwards (<= 2.6 pads them itself) and by every backward; the
architectures each FA2 version accepts and its backward head-dim rules per architecture;
on ROCm the CK backend ignores softcap and the Triton backend ignores window and softcap;
a ``-inf`` lse handed to a backward is read as 0 (the kernels' guard for an empty row max);
the old APIs return gradients, the new ones write them in place.  The device the stand-in
"runs on" is the one :func:`usp_hal.dispatch.platform.emulate` reports.  They prove the *adapter*,
not the kernel.
"""
from __future__ import annotations

import inspect
import textwrap

from usp_hal.dispatch.backend import parse_version

FA2_DIST = "flash-attn"
FA3_DIST = "flash_attn_3"
FA2_TOP_LEVEL = ("flash_attn", "flash_attn_2_cuda")
FA3_TOP_LEVEL = ("flash_attn_interface", "flash_attn_3", "flash_attn_config")


# ---------------------------------------------------------------------------------- kernel math
# These functions are copied verbatim into each stand-in extension module.

def _standin_scores(q, k, scale, causal, left, right, softcap, alibi_slopes, additive_causal_alibi,
                    fa3_normalisation=False):
    """Scores [B, H, Sq, Sk] in float32 with the kernels' masking, plus tanh(x/softcap)."""
    import torch
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    x = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(x / softcap)
        x = softcap * t
    # the kernels' own window normalisation
    if fa3_normalisation:
        # Dao-AILab/flash-attention hopper/flash_api.cpp mha_fwd/mha_bwd (since 7a802796)
        if left >= sk - 1:
            left = -1
        if right >= sq - 1:
            right = -1
        if causal:
            right = 0
    else:
        # Dao-AILab/flash-attention v2.8.3 csrc/flash_attn/flash_api.cpp mha_fwd/mha_bwd: the right
        # bound is dropped from Sk on, which is wrong once Sq >= Sk + 2
        if left >= sk:
            left = -1
        if right >= sk:
            right = -1
        if causal:
            right = 0
    causal_path = left < 0 and right == 0
    row = torch.arange(sq).view(sq, 1) + (sk - sq)     # bottom-right alignment
    col = torch.arange(sk).view(1, sk)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= col >= row - left
    if right >= 0:
        keep &= col <= row + right
    if alibi_slopes is not None:
        sl = alibi_slopes.float()
        sl = sl.view(1, h, 1, 1) if sl.dim() == 1 else sl.view(b, h, 1, 1)
        if causal_path and additive_causal_alibi:
            x = x + sl * col.float()
        else:
            x = x - sl * (row - col).abs().float()
    x = x.masked_fill(~keep, float("-inf"))
    return x, t


def _standin_forward(q, k, v, scale, causal, left, right, softcap, alibi_slopes, empty_row_lse,
                     additive_causal_alibi, fa3_normalisation=False):
    """(out [B, Sq, H, D] in q.dtype, lse [B, H, Sq] float32)."""
    import torch
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if sk == 0:
        return q.new_zeros(b, sq, h, v.shape[-1]), torch.full((b, h, sq), float("inf"))
    s, _ = _standin_scores(q, k, scale, causal, left, right, softcap, alibi_slopes, additive_causal_alibi,
                           fa3_normalisation)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - finite.unsqueeze(-1))
    vf = v.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    out = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
    lse = torch.where(lse == float("-inf"), torch.full_like(lse, empty_row_lse), lse)
    return out, lse.contiguous()


def _standin_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap, alibi_slopes,
                      additive_causal_alibi, fa3_normalisation=False):
    """(dq, dk, dv) in float32 from the given out and lse (which may be the ring-merged ones)."""
    import torch
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    s, t = _standin_scores(q, k, scale, causal, left, right, softcap, alibi_slopes, additive_causal_alibi,
                           fa3_normalisation)
    lse = lse.float()
    lse = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)   # empty-row-max guard
    p = torch.exp(s - lse.unsqueeze(-1))
    do = dout.float().transpose(1, 2)
    o = out.float().transpose(1, 2)
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale

    def per_kv_head(x):
        return x.view(b, hkv, g, sk, x.shape[-1]).sum(2).transpose(1, 2)
    return dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv)


def _standin_check_inputs(tensors, pad_ok, name):
    import torch
    q = tensors[0]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for x in tensors:
        if x.dtype != q.dtype:
            raise RuntimeError(f"{name}: all tensors must have the same dtype")
        if x.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if not pad_ok and q.shape[-1] % 8:
        raise RuntimeError("head_size should be a multiple of 8")


def _standin_device():
    """(device type, compute capability) the stand-in runs on: the emulated device."""
    from usp_hal.dispatch import platform
    em = platform.emulated()
    if em is None:
        raise RuntimeError("stand-in kernel called outside usp_hal.dispatch.platform.emulate(): no device to run on")
    return em.device_type, em.compute_capability


def _standin_fa2_arch_check(version, cc, backward, head_size):
    """The architecture checks of FA2's mha_fwd/mha_bwd for this version (CUDA only)."""
    from packaging.version import Version
    v = Version(version)
    if v < Version("2.7.3"):
        # v2.5.0..v2.7.2 csrc/flash_attn/flash_api.cpp: is_sm8x = major == 8; is_sm90 = cc == 9.0
        if not (cc[0] == 8 or tuple(cc) == (9, 0)):
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    elif cc[0] < 8:
        # v2.7.3+ csrc/flash_attn/flash_api.cpp: is_sm8x_min = major >= 8
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    sm80_or_90 = tuple(cc) in ((8, 0), (9, 0))
    if backward and not sm80_or_90:
        # v2.5.0..v2.5.4 mha_bwd: head_size > 192 needs A100/H100;
        # v2.5.5..v2.6.1 mha_bwd: head_size > 192 && head_size <= 224 (without dropout)
        if Version("2.5.0") <= v < Version("2.5.5") and head_size > 192:
            raise RuntimeError("FlashAttention backward for head dim > 192 requires A100/A800 or H100/H800")
        if Version("2.5.5") <= v < Version("2.6.2") and 192 < head_size <= 224:
            raise RuntimeError("FlashAttention backward for head dim 256 with dropout, or head dim 224 "
                               "with/without dropout requires A100/A800 or H100/H800")


def _math_source() -> str:
    funcs = (_standin_scores, _standin_forward, _standin_backward, _standin_check_inputs, _standin_device,
             _standin_fa2_arch_check)
    return "import torch\n\n" + "\n\n".join(inspect.getsource(f) for f in funcs) + "\n"


# ---------------------------------------------------------------------------------- FA2
def _fa2_ext(version: str) -> str:
    """Top-level ``flash_attn_2_cuda``: mha_fwd / mha_bwd with the C++ argument order."""
    v = parse_version(version)
    softcap = v >= parse_version("2.6.0")
    new = v >= parse_version("2.7.0")
    sc_arg = "softcap, " if softcap else ""
    sc_val = "softcap" if softcap else "0.0"
    fwd_ret = ("[out, softmax_lse, p, rng_state]" if new
               else "[out[..., :d_og], q, k, v, out, softmax_lse, p, rng_state]")
    varlen_fwd_ret = fwd_ret if new else "[out[..., :d_og], q, k, v, out, softmax_lse, p, rng_state]"
    # mha_varlen_fwd's optional tensors: block_table_ from 2.5.7, leftpad_k_ from 2.6.1
    # (v2.5.0, v2.5.7, v2.7.0 csrc/flash_attn/flash_api.cpp mha_varlen_fwd)
    block_arg = "block_table_, " if v >= parse_version("2.5.7") else ""
    leftpad_arg = "leftpad_k_, " if v >= parse_version("2.6.1") else ""
    unpadded = v >= parse_version("2.6.0")
    return _math_source() + textwrap.dedent(f'''
        def _pad8(x):
            d = x.shape[-1]
            return x if d % 8 == 0 else torch.nn.functional.pad(x, (0, 8 - d % 8))


        VERSION = "{version}"
        # True when this module stands for flash_attn/flash_attn_triton_amd/interface_fa.py (the
        # Triton AMD build: no flash_attn_2_cuda; the same fwd/bwd/varlen_fwd/varlen_bwd signatures)
        TRITON_AMD = False


        def _rocm_ignores(window_size_left, window_size_right, softcap):
            """What the ROCm builds drop: the CK backend ignores softcap (v2.8.3
            csrc/flash_attn_ck/mha_fwd.cpp, mha_bwd.cpp); the Triton AMD backend ignores softcap and the
            window on any device (v2.8.3 flash_attn/flash_attn_triton_amd/interface_fa.py: the parameters
            are never used; the window is ignored by the real kernel under the Triton interpreter too)."""
            import os
            if TRITON_AMD:
                return -1, -1, 0.0
            device, _ = _standin_device()
            if device != "rocm":
                return window_size_left, window_size_right, softcap
            if os.environ.get("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE") == "TRUE":
                return -1, -1, 0.0
            return window_size_left, window_size_right, 0.0


        def fwd(q, k, v, out_, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left,
                window_size_right, {sc_arg}return_softmax, gen_):
            device, cc = _standin_device()
            if device == "cuda" and not TRITON_AMD:
                _standin_fa2_arch_check(VERSION, cc, False, q.shape[-1])
            _standin_check_inputs((q, k, v), pad_ok={not new}, name="mha_fwd")
            window_size_left, window_size_right, _cap = _rocm_ignores(window_size_left, window_size_right,
                                                                      {sc_val})
            if p_dropout > 0:
                raise RuntimeError("stand-in: dropout is not modelled")
            if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
                raise RuntimeError("ALiBi slopes must have dtype fp32")
            if q.shape[2] % k.shape[2]:
                raise RuntimeError("Number of heads in key/value must divide number of heads in query")
            d_og = q.shape[-1]
            q, k, v = _pad8(q), _pad8(k), _pad8(v)      # <= 2.6 pads inside mha_fwd
            if TRITON_AMD and alibi_slopes is not None:
                # flash_attn_triton_amd/utils.py MetaData.need_alibi: assert alibi_slopes.dim() == 2 ([B, H])
                assert alibi_slopes.dim() == 2 and alibi_slopes.shape[0] == q.shape[0]
            out, softmax_lse = _standin_forward(q, k, v, softmax_scale, is_causal, window_size_left,
                                                window_size_right, _cap, alibi_slopes,
                                                float("inf"), not TRITON_AMD)
            p = torch.empty(0)
            rng_state = torch.zeros(2, dtype=torch.int64)
            return {fwd_ret}


        BWD_CALLS = []   # flags of each backward call, for the tests


        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale,
                is_causal, window_size_left, window_size_right, {sc_arg}deterministic, gen_, rng_state):
            BWD_CALLS.append(dict(deterministic=deterministic, causal=is_causal,
                                  window=(window_size_left, window_size_right)))
            device, cc = _standin_device()
            if device == "cuda" and not TRITON_AMD:
                _standin_fa2_arch_check(VERSION, cc, True, q.shape[-1])
            _standin_check_inputs((q, k, v, out, dout), pad_ok=False, name="mha_bwd")
            window_size_left, window_size_right, _cap = _rocm_ignores(window_size_left, window_size_right,
                                                                      {sc_val})
            if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != (q.shape[0], q.shape[2], q.shape[1]):
                raise RuntimeError("softmax_lse must be float32 [B, H, Sq]")
            for g, x in ((dq, q), (dk, k), (dv, v)):
                if g is not None and g.shape != x.shape:
                    raise RuntimeError("gradient buffers must match q/k/v")
            gq, gk, gv = _standin_backward(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal,
                                           window_size_left, window_size_right, _cap, alibi_slopes,
                                           not TRITON_AMD)   # Triton AMD: utils.py compute_alibi_block
            dq = torch.empty_like(q) if dq is None else dq
            dk = torch.empty_like(k) if dk is None else dk
            dv = torch.empty_like(v) if dv is None else dv
            dq.copy_(gq); dk.copy_(gk); dv.copy_(gv)
            softmax_d = torch.zeros(q.shape[0], q.shape[2], (q.shape[1] + 127) // 128 * 128)
            return [dq, dk, dv, softmax_d]


        VARLEN_CALLS = []   # (direction, causal, number of sequences) of each varlen call, for the tests
        # varlen lse: [n_seq, H, max_seqlen_q] before 2.6.0, [H, total_q] from 2.6.0 (v2.5.9 / v2.6.0
        # csrc/flash_attn/flash_api.cpp mha_varlen_fwd: softmax_lse = torch::empty(...))
        UNPADDED_LSE = {unpadded}


        def _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            for t in (cu_seqlens_q, cu_seqlens_k):
                if t.dtype != torch.int32:
                    raise RuntimeError("cu_seqlens_q must have dtype int32")
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            if len(cq) != len(ck):
                raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1)")
            for i in range(len(cq) - 1):
                if cq[i + 1] - cq[i] > max_seqlen_q or ck[i + 1] - ck[i] > max_seqlen_k:
                    raise RuntimeError("stand-in: a sequence longer than max_seqlen (the kernel would "
                                       "read out of bounds)")
                yield i, cq[i], cq[i + 1], ck[i], ck[i + 1]


        def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, {leftpad_arg}{block_arg}alibi_slopes,
                       max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                       window_size_left, window_size_right, {sc_arg}return_softmax, gen_):
            VARLEN_CALLS.append(("fwd", is_causal, cu_seqlens_q.numel() - 1))
            device, cc = _standin_device()
            if device == "cuda" and not TRITON_AMD:
                _standin_fa2_arch_check(VERSION, cc, False, q.shape[-1])
            _standin_check_inputs((q, k, v), pad_ok={not new}, name="mha_varlen_fwd")
            if q.dim() != 3 or k.dim() != 3:
                raise RuntimeError("q must be (total_q, num_heads, head_size), k/v (total_k, num_heads_k, head_size)")
            if p_dropout > 0 or seqused_k is not None or alibi_slopes is not None:
                raise RuntimeError("stand-in: dropout, seqused_k and alibi are not modelled in varlen")
            # v2.8.3 mha_varlen_fwd: window bounds normalised against max_seqlen_k
            if window_size_left >= max_seqlen_k:
                window_size_left = -1
            if window_size_right >= max_seqlen_k:
                window_size_right = -1
            window_size_left, window_size_right, _cap = _rocm_ignores(window_size_left, window_size_right,
                                                                      {sc_val})
            d_og, h = q.shape[-1], q.shape[1]
            q, k, v = _pad8(q), _pad8(k), _pad8(v)      # <= 2.6 pads inside mha_varlen_fwd
            out = torch.zeros_like(q)
            n = cu_seqlens_q.numel() - 1
            if UNPADDED_LSE:
                softmax_lse = torch.full((h, q.shape[0]), float("nan"))
            else:   # padding positions are never written (torch::empty): NaN here
                softmax_lse = torch.full((n, h, max_seqlen_q), float("nan"))
            for i, a, b, c, d in _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                o, l = _standin_forward(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale, is_causal,
                                        window_size_left, window_size_right, _cap, None, float("inf"), True)
                out[a:b] = o[0]
                if UNPADDED_LSE:
                    softmax_lse[:, a:b] = l[0]
                else:
                    softmax_lse[i, :, :b - a] = l[0]
            if TRITON_AMD:
                # flash_attn_triton_amd/fwd_prefill.py attention_prefill_forward_triton_impl: the varlen
                # ("thd") lse is allocated [total_q, nheads_q] (seen under the Triton interpreter)
                softmax_lse = softmax_lse.t().contiguous()
            p = torch.empty(0)
            rng_state = torch.zeros(2, dtype=torch.int64)
            return {varlen_fwd_ret}


        def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                       max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                       window_size_left, window_size_right, {sc_arg}deterministic, gen_, rng_state):
            VARLEN_CALLS.append(("bwd", is_causal, cu_seqlens_q.numel() - 1))
            device, cc = _standin_device()
            if device == "cuda" and not TRITON_AMD:
                _standin_fa2_arch_check(VERSION, cc, True, q.shape[-1])
            _standin_check_inputs((q, k, v, out, dout), pad_ok=False, name="mha_varlen_bwd")
            if window_size_left >= max_seqlen_k:
                window_size_left = -1
            if window_size_right >= max_seqlen_k:
                window_size_right = -1
            window_size_left, window_size_right, _cap = _rocm_ignores(window_size_left, window_size_right,
                                                                      {sc_val})
            n, h = cu_seqlens_q.numel() - 1, q.shape[1]
            want = (h, q.shape[0]) if UNPADDED_LSE else (n, h, max_seqlen_q)
            if TRITON_AMD:
                # bwd_prefill_split.py: the varlen lse is read with the strides of [total_q, nheads_q]
                want = (q.shape[0], h)
            if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != want:
                raise RuntimeError(f"softmax_lse must be float32 {{want}}, got {{tuple(softmax_lse.shape)}}")
            if TRITON_AMD:
                softmax_lse = softmax_lse.t()
            dq = torch.empty_like(q) if dq is None else dq
            dk = torch.empty_like(k) if dk is None else dk
            dv = torch.empty_like(v) if dv is None else dv
            for t, x in ((dq, q), (dk, k), (dv, v)):
                if t.shape != x.shape:
                    raise RuntimeError("gradient buffers must match q/k/v")
            dk.zero_(); dv.zero_()
            for i, a, b, c, d in _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                lse_i = softmax_lse[:, a:b] if UNPADDED_LSE else softmax_lse[i, :, :b - a]
                gq, gk, gv = _standin_backward(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d],
                                               out[None, a:b], lse_i[None], softmax_scale, is_causal,
                                               window_size_left, window_size_right, _cap, None, True)
                dq[a:b] = gq[0]
                dk[c:d] += gk[0].to(dk.dtype)
                dv[c:d] += gv[0].to(dv.dtype)
            softmax_d = torch.zeros(h, q.shape[0] + 128 * n)
            return [dq, dk, dv, softmax_d]
    ''')


def _fa2_iface(version: str) -> str:
    v = parse_version(version)
    if v >= parse_version("2.7.0"):
        # custom ops as in >= 2.7 (a fresh namespace per install so re-installs do not clash)
        return textwrap.dedent('''
            import uuid
            from typing import Optional, Tuple

            import torch

            import flash_attn_2_cuda as flash_attn_gpu

            _NS = "standin_fa2_" + uuid.uuid4().hex[:12]


            @torch.library.custom_op(_NS + "::_flash_attn_forward", mutates_args=(), device_types="cpu")
            def _flash_attn_forward(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], return_softmax: bool,
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                out, softmax_lse, S_dmask, rng_state = flash_attn_gpu.fwd(
                    q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal,
                    window_size_left, window_size_right, softcap, return_softmax, None)
                return out, softmax_lse, S_dmask, rng_state


            @torch.library.custom_op(_NS + "::_flash_attn_backward", mutates_args=("dq", "dk", "dv"),
                                     device_types="cpu")
            def _flash_attn_backward(
                dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                window_size_left: int, window_size_right: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                rng_state: Optional[torch.Tensor] = None,
            ) -> torch.Tensor:
                dq, dk, dv, softmax_d = flash_attn_gpu.bwd(
                    dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale,
                    causal, window_size_left, window_size_right, softcap, deterministic, None, rng_state)
                return softmax_d


            # v2.7.0 / v2.8.3 flash_attn/flash_attn_interface.py _flash_attn_varlen_forward/_backward
            @torch.library.custom_op(_NS + "::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
            def _flash_attn_varlen_forward(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False,
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                out, softmax_lse, S_dmask, rng_state = flash_attn_gpu.varlen_fwd(
                    q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal, window_size_left,
                    window_size_right, softcap, return_softmax, None)
                return out, softmax_lse, S_dmask, rng_state


            @torch.library.custom_op(_NS + "::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                                     device_types="cpu")
            def _flash_attn_varlen_backward(
                dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                window_size_left: int, window_size_right: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False,
            ) -> torch.Tensor:
                dq, dk, dv, softmax_d = flash_attn_gpu.varlen_bwd(
                    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal, window_size_left,
                    window_size_right, softcap, deterministic, None, rng_state)
                return softmax_d
        ''')
    softcap = v >= parse_version("2.6.0")
    sc_param = "softcap, " if softcap else ""
    # _flash_attn_varlen_forward's parameters after ``causal`` per version (flash_attn/flash_attn_interface.py
    # at v2.5.0, v2.5.7, v2.6.0, v2.6.1, v2.6.2): block_table from 2.5.7 (no default until 2.6.1),
    # leftpad_k from 2.6.1, seqused_k from 2.6.2 with defaults everywhere; and what reaches varlen_fwd
    if v >= parse_version("2.6.2"):
        varlen_tail = ("window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, "
                       "block_table=None, leftpad_k=None, seqused_k=None")
        varlen_opt = "seqused_k, leftpad_k, block_table, "
    elif v >= parse_version("2.6.1"):
        varlen_tail = ("window_size, softcap, alibi_slopes, return_softmax, block_table=None, leftpad_k=None")
        varlen_opt = "None, leftpad_k, block_table, "
    elif v >= parse_version("2.5.7"):
        varlen_tail = f"window_size, {sc_param}alibi_slopes, return_softmax, block_table"
        varlen_opt = "None, block_table, "
    else:
        varlen_tail = "window_size, alibi_slopes, return_softmax"
        varlen_opt = "None, "
    return textwrap.dedent(f'''
        import flash_attn_2_cuda as flash_attn_cuda


        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, {sc_param}alibi_slopes,
                                return_softmax):
            out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state = flash_attn_cuda.fwd(
                q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal, window_size[0], window_size[1],
                {sc_param}return_softmax, None)
            return out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state


        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size, {sc_param}alibi_slopes, deterministic, rng_state=None):
            dq, dk, dv, softmax_d = flash_attn_cuda.bwd(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale, causal,
                window_size[0], window_size[1], {sc_param}deterministic, None, rng_state)
            return dq, dk, dv, softmax_d


        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                       softmax_scale, causal, {varlen_tail}):
            out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state = flash_attn_cuda.varlen_fwd(
                q, k, v, None, cu_seqlens_q, cu_seqlens_k, {varlen_opt}alibi_slopes, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, False, causal, window_size[0], window_size[1],
                {sc_param}return_softmax, None)
            return out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state


        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                        {sc_param}alibi_slopes, deterministic, rng_state=None):
            dq, dk, dv, softmax_d = flash_attn_cuda.varlen_bwd(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, False, causal, window_size[0],
                window_size[1], {sc_param}deterministic, None, rng_state)
            return dq, dk, dv, softmax_d
    ''')


def _literal_namespace(src: str, namespace: str) -> str:
    """Register the custom ops under a literal ``namespace::`` name, written the way the real
    interface files write it (so it can be read from the file, as the adapters do)."""
    for op in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
               "_flash_attn_varlen_backward"):
        src = src.replace(f'_NS + "::{op}"', f'"{namespace}::{op}"')
    return src


_CUDA_IMPORT = "import flash_attn_2_cuda as flash_attn_gpu\n"
# v2.8.3 flash_attn/flash_attn_interface.py: the kernel module is chosen once, at import time
_TRITON_AMD_IMPORT = textwrap.dedent('''
    import os
    USE_TRITON_ROCM = os.getenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE") == "TRUE"
    if USE_TRITON_ROCM:
        from .flash_attn_triton_amd import interface_fa as flash_attn_gpu
    else:
        import flash_attn_2_cuda as flash_attn_gpu
''')


def fa2_files(version: str, *, with_extension: bool = True, op_namespace: "str | None" = None,
              triton_amd: bool = False) -> dict:
    """FA2 stand-in files.  ``op_namespace`` writes the >= 2.7 custom ops under that literal
    namespace (the real package uses ``flash_attn``); by default a fresh one per install.
    ``triton_amd``: also the Triton AMD kernel module ``flash_attn/flash_attn_triton_amd/interface_fa.py``
    and the interface's import switch on FLASH_ATTENTION_TRITON_AMD_ENABLE (>= 2.7 only)."""
    iface = _fa2_iface(version)
    if op_namespace:
        iface = _literal_namespace(iface, op_namespace)
    files = {
        "flash_attn/__init__.py": f'__version__ = "{version}"\n\n'
                                  "from flash_attn.flash_attn_interface import _flash_attn_forward  # noqa: F401\n",
        "flash_attn/flash_attn_interface.py": iface,
    }
    if triton_amd:
        if _CUDA_IMPORT not in iface:
            raise ValueError(f"stand-in: no Triton AMD switch modelled for flash-attn {version}")
        files["flash_attn/flash_attn_interface.py"] = iface.replace(_CUDA_IMPORT, _TRITON_AMD_IMPORT, 1)
        files["flash_attn/flash_attn_triton_amd/__init__.py"] = ""
        files["flash_attn/flash_attn_triton_amd/interface_fa.py"] = _fa2_ext(version).replace(
            "TRITON_AMD = False", "TRITON_AMD = True", 1)
    if with_extension:
        files["flash_attn_2_cuda.py"] = _fa2_ext(version)
    return files


# ---------------------------------------------------------------------------------- FA3
_FA3_EXT = textwrap.dedent('''
    # mha_fwd / mha_bwd of the extension (old builds return dq, dk, dv first; the custom-op
    # builds mutate them and return softmax_d first)
    _BWD_RETURNS_GRADS = {grads_first}
    BWD_CALLS = []   # flags of each backward call, for the tests


    VARLEN_CALLS = []       # (direction, causal, number of sequences) of each varlen call, for the tests
    VARLEN_DISABLED = False  # a build compiled with FLASHATTENTION_DISABLE_VARLEN


    def _check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        # hopper/flash_api.cpp mha_fwd/mha_bwd (7a802796 .. 0251105a)
        if VARLEN_DISABLED:
            raise RuntimeError("This flash attention build does not support varlen.")
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise RuntimeError("stand-in: only cu_seqlens on both q and k is modelled")
        if max_seqlen_q is None or max_seqlen_k is None:
            raise RuntimeError("max_seqlen_q must be provided if cu_seqlens_q is provided")
        for t in (cu_seqlens_q, cu_seqlens_k):
            if t.dtype != torch.int32:
                raise RuntimeError("cu_seqlens_q must have dtype torch.int32")


    def _varlen_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if len(cq) != len(ck):
            raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1)")
        for i in range(len(cq) - 1):
            if cq[i + 1] - cq[i] > max_seqlen_q or ck[i + 1] - ck[i] > max_seqlen_k:
                raise RuntimeError("stand-in: a sequence longer than max_seqlen (the kernel would read out of "
                                   "bounds)")
            yield cq[i], cq[i + 1], ck[i], ck[i + 1]


    def _fa3_arch_check():
        # hopper/setup.py compiles sm_90a kernels (plus sm_80 ones); sm_90a code does not run on
        # other architectures, and hopper/flash_api.cpp refuses anything below sm80
        device, cc = _standin_device()
        if device != "cuda" or not (cc[0] == 8 or tuple(cc) == (9, 0)):
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    def fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
            max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
            seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left,
            window_size_right, attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits,
            pack_gqa, sm_margin):
        unused = (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k,
                  page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, q_descale, k_descale, v_descale)
        if any(x is not None for x in unused):
            raise RuntimeError("stand-in: only dense or cu_seqlens-packed q/k/v are modelled")
        _fa3_arch_check()
        _standin_check_inputs((q, k, v), pad_ok=False, name="mha_fwd")
        head_size, head_size_v = q.shape[-1], v.shape[-1]
        if head_size_v % 8:
            raise RuntimeError("head_size_v should be a multiple of 8")
        if head_size_v != head_size:
            # hopper/flash_api.cpp mha_fwd (0251105a)
            if not ((128 < head_size <= 192 and 96 < head_size_v <= 128) or (head_size <= 64 and head_size_v <= 512)):
                raise RuntimeError("If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] "
                                   "and V headdim in (96, 128], or (Q/K <= 64 and V <= 512).")
            if _standin_device()[1][0] != 9:
                raise RuntimeError("Only Hopper supports different V headdim")
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            VARLEN_CALLS.append(("fwd", is_causal, cu_seqlens_q.numel() - 1))
            _check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            h = q.shape[1]
            out = q.new_zeros(*q.shape[:-1], v.shape[-1])
            # hopper/flash_api.cpp mha_fwd: varlen lse is [num_heads, total_q]
            softmax_lse = torch.full((h, q.shape[0]), float("nan"))
            for a, b, c, d in _varlen_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                o, l = _standin_forward(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale, is_causal,
                                        window_size_left, window_size_right, softcap, None, float("-inf"), False,
                                        True)
                out[a:b] = o[0]
                softmax_lse[:, a:b] = l[0]
            return out, softmax_lse, None, None
        out, softmax_lse = _standin_forward(q, k, v, softmax_scale, is_causal, window_size_left, window_size_right,
                                            softcap, None, float("-inf"), False, True)
        return out, softmax_lse, None, None


    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
            deterministic, sm_margin):
        BWD_CALLS.append(dict(deterministic=deterministic, causal=is_causal,
                              window=(window_size_left, window_size_right)))
        _fa3_arch_check()
        _standin_check_inputs((q, k, v, out, dout), pad_ok=False, name="mha_bwd")
        if v.shape[-1] % 8 or max(q.shape[-1], v.shape[-1]) > 256:
            # hopper/flash_api.cpp mha_bwd (0251105a): head_size_v % 8, max(head_size, head_size_v) <= max_headdim
            raise RuntimeError("head_size_v should be a multiple of 8; FlashAttention forward only supports head "
                               "dimension at most 256")
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            return _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, softmax_scale, is_causal, window_size_left,
                               window_size_right, softcap)
        if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != (q.shape[0], q.shape[2], q.shape[1]):
            raise RuntimeError("softmax_lse must be float32 [B, H, Sq]")
        if deterministic and max(q.shape[-1], v.shape[-1]) > 192:
            # hopper/flash_api.cpp mha_bwd: !deterministic || head_size_rounded < 256
            raise RuntimeError("Deterministic backward not supported for hdim 256.")
        gq, gk, gv = _standin_backward(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal,
                                       window_size_left, window_size_right, softcap, None, False, True)
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        dq.copy_(gq); dk.copy_(gk); dv.copy_(gv)
        softmax_d = torch.zeros(q.shape[0], q.shape[2], (q.shape[1] + 127) // 128 * 128)
        if _BWD_RETURNS_GRADS:
            return dq, dk, dv, softmax_d, None, None, None, None
        return softmax_d, None, None, None, None


    def _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right, softcap):
        VARLEN_CALLS.append(("bwd", is_causal, cu_seqlens_q.numel() - 1))
        _check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        h = q.shape[1]
        # the kernel reads the lse in the layout its varlen forward wrote: [num_heads, total_q]
        if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != (h, q.shape[0]):
            raise RuntimeError(f"stand-in: varlen softmax_lse must be float32 [H, total_q] = {(h, q.shape[0])}")
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        dk.zero_(); dv.zero_()
        for a, b, c, d in _varlen_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            gq, gk, gv = _standin_backward(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                                           softmax_lse[None, :, a:b], softmax_scale, is_causal, window_size_left,
                                           window_size_right, softcap, None, False, True)
            dq[a:b] = gq[0]
            dk[c:d] += gk[0].to(dk.dtype)
            dv[c:d] += gv[0].to(dv.dtype)
        softmax_d = torch.zeros(h, q.shape[0] + 128 * (cu_seqlens_q.numel() - 1))
        if _BWD_RETURNS_GRADS:
            return dq, dk, dv, softmax_d, None, None, None, None
        return softmax_d, None, None, None, None
''')

_FA3_IFACE_NEW = textwrap.dedent('''
    import uuid
    from typing import Optional, Tuple

    import torch

    import flash_attn_3._C as flash_attn_3_gpu

    _NS = "standin_fa3_" + uuid.uuid4().hex[:12]


    @torch.library.custom_op(_NS + "::_flash_attn_forward", mutates_args=(), device_types="cpu")
    def _flash_attn_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None,
        qv: Optional[torch.Tensor] = None, out_: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
        cu_seqlens_k_new: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None, page_table: Optional[torch.Tensor] = None,
        kv_batch_idx: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
        rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
        seqlens_rotary: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
        k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
        softmax_scale: Optional[float] = None, causal: bool = False, window_size_left: int = -1,
        window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
        rotary_interleaved: bool = True, scheduler_metadata: Optional[torch.Tensor] = None,
        num_splits: int = 1, pack_gqa: Optional[bool] = None, sm_margin: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, softmax_lse, out_accum, softmax_lse_accum = flash_attn_3_gpu.fwd(
            q, k, v, k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
            seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
            rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
            window_size_left, window_size_right, attention_chunk, softcap, rotary_interleaved,
            scheduler_metadata, num_splits, pack_gqa, sm_margin)
        if out_accum is None:
            out_accum = torch.tensor([])
        if softmax_lse_accum is None:
            softmax_lse_accum = torch.tensor([])
        return out, softmax_lse, out_accum, softmax_lse_accum


    @torch.library.custom_op(_NS + "::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
    def _flash_attn_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_k: Optional[torch.Tensor] = None, sequed_q: Optional[torch.Tensor] = None,
        sequed_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None, dq: Optional[torch.Tensor] = None,
        dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
        softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
        window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
    ) -> torch.Tensor:
        softmax_d, *rest = flash_attn_3_gpu.bwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right,
            softcap, deterministic, sm_margin)
        return softmax_d
''')

_FA3_IFACE_OLD = textwrap.dedent('''
    import torch

    import flash_attn_3._C as flash_attn_3_cuda


    def _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                            seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx,
                            leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale,
                            softmax_scale, causal, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None,
                            sm_margin=0):
        out, softmax_lse, *rest = flash_attn_3_cuda.fwd(
            q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
            max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
            seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size[0],
            window_size[1], attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits,
            pack_gqa, sm_margin)
        return out, softmax_lse, *rest


    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                             max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                             softcap=0.0, deterministic=False, sm_margin=0):
        dq, dk, dv, softmax_d, *rest = flash_attn_3_cuda.bwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size[0], window_size[1], softcap,
            deterministic, sm_margin)
        return dq, dk, dv, softmax_d
''')


def fa3_files(api: str, *, top_level: bool = True, op_namespace: "str | None" = None) -> dict:
    """FA3 stand-in files for ``api`` "old" or "new".  ``top_level=False`` installs the
    interface only as ``flash_attn_3.flash_attn_interface`` (the package re-export path).
    ``op_namespace`` writes the custom ops (new API) under that literal namespace: builds
    from 2025-07-16 to 2025-08-19 used ``flash_attn``, later ones ``flash_attn_3``
    (Dao-AILab/flash-attention c7697bbf, fde4bc0c hopper/flash_attn_interface.py)."""
    iface = {"old": _FA3_IFACE_OLD, "new": _FA3_IFACE_NEW}[api]
    if op_namespace:
        iface = _literal_namespace(iface, op_namespace)
    files = {
        "flash_attn_3/__init__.py": "",
        "flash_attn_3/_C.py": _math_source() + _FA3_EXT.replace("{grads_first}", str(api == "old")),
    }
    if top_level:
        files["flash_attn_interface.py"] = iface
        files["flash_attn_3/flash_attn_interface.py"] = "from flash_attn_interface import *  # noqa: F401,F403\n" \
                                                        "from flash_attn_interface import _flash_attn_forward, " \
                                                        "_flash_attn_backward  # noqa: F401\n"
    else:
        files["flash_attn_3/flash_attn_interface.py"] = iface
    return files


# ---------------------------------------------------------------------------------- test helpers
def make_inputs(*, b=2, sq=16, sk=16, h=4, hkv=4, d=64, dtype, seed=0):
    """q, k, v, dout in ``dtype`` (the reference sees exactly these values, upcast)."""
    from tests.dist_cases import kernel_inputs
    return kernel_inputs(b, sq, sk, h, hkv, d, dtype, seed)


def reference(q, k, v, dout, **kw):
    """float64 reference (out, lse, dq, dk, dv) through autograd."""
    import torch

    from usp_hal.dispatch.reference import reference_attention
    qd, kd, vd = (x.to(torch.float64).requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(qd, kd, vd, **kw)
    out.backward(dout.to(torch.float64))
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def assert_matches(actual, expected, dtype, what):
    """Compare with the per-dtype tolerance of usp_hal.dispatch.reference (infinities must match)."""
    import torch

    from usp_hal.dispatch.reference import tolerance
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")
