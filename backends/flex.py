"""torch FlexAttention (``torch.nn.attention.flex_attention``): masks and score changes as code.

The contract's positions (causal, window, the key offset of a ring block) and its boolean
``mask=`` become one ``mask_mod`` over the block's local indices, turned into a
``BlockMask`` with ``create_block_mask``; softcap and alibi become a ``score_mod``.  The mask
tensor and every position scalar are captured as tensors, so one compiled graph serves every
call of the same structure (a Python int captured in a mod would be specialised into it).

What torch 2.13.0 does (pytorch v2.13.0 torch/nn/attention/flex_attention.py; checked by
running it on this CPU, and for CUDA by reading the sources named below):

* ``flex_attention(..., return_aux=AuxRequest(lse=True))`` gives the lse ``[B, H, Sq]``
  float32 (float64 for float64 inputs) in *natural* log: the kernels work in base 2 and
  ``flex_attention._finalize_outputs`` multiplies by ln 2 (``stats_are_log2``).  A row that
  its masks leave without keys gets out 0 and lse ``-inf`` (CPU: ``math_attention``'s
  ``masked_rows``; CUDA: ``templates/flex_attention.py.jinja``, ``l_i`` set to 1 where it is
  0 and ``lse = m_i + log2(l_i)`` with ``m_i = -inf``).
* CPU: called without ``torch.compile`` it runs the unfused implementation
  (``torch/_higher_order_ops/flex_attention.py`` ``math_attention``: the full score matrix
  of the call in fp32, fp64 for fp64), which does return the lse when it is asked for.
  The compiled CPU kernel does not (``torch/_inductor/kernel/flex/flex_cpu.py``: "torch.compile
  on CPU only supports inference and `return_lse` is not supported yet"), so the adapter runs
  the CPU path uncompiled.  No CPU path has a backward: ``_validate_device`` raises for any
  input that requires grad ("FlexAttention does not support backward on CPU").  So on the
  CPU flex serves forward calls, ring blocks included (it has an lse), and no backward.
* CUDA: the adapter calls ``torch.compile(flex_attention)`` (the Triton template; head dims
  below 16 are refused by ``torch/_inductor/kernel/flex/flex_attention.py`` "NYI: embedding
  dimension ... must be at least 16").  Lengths that are not multiples of the 128-wide
  blocks are padded by ``create_block_mask`` (``_convert_mask_to_block_mask``) and masked by
  the kernel (``common.py.jinja``: indices taken modulo the length, scores past ``KV_LEN`` set
  to ``-inf``), so a mask tensor indexed by the mods is never read out of bounds.
  The backward is flex's autograd: the block is recomputed with grad and differentiated
  through its own out *and* lse, re-weighted so that the result is the gradient under the
  given (possibly ring-merged) ``out``/``lse`` (see ``kernel_backward``).  None of the CUDA
  path has run here: it is checked on a stand-in (torch's own unfused flex with its CPU
  refusal lifted), which proves the adapter, not the Triton kernels.

Causal/window are top-left by construction (the mods see the contract's positions), so any
``Sq``/``Sk`` is served.  Packed documents run as one dense call per piece.
"""
from __future__ import annotations

import functools
import warnings

import torch

from usp_hal.dispatch.backend import AttentionBackend, normalize_lse
from usp_hal.dispatch.capabilities import KernelCall, Limit
from usp_hal.dispatch.platform import device_type_of

SRC = "pytorch v2.13.0"


def _eager_ops():
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    return flex_attention, create_block_mask, AuxRequest


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    # static shapes: the block shapes of a model repeat, and torch 2.13 fails to trace the autograd path of
    # flex with a dynamic (symbolic) scale; each new shape is one more compile
    return torch.compile(flex_attention, dynamic=False)


def flex_ops(device_type: str):
    """``(flex_attention, create_block_mask, AuxRequest)`` for a device type, looked up at call
    time: the compiled function on CUDA, the uncompiled one on the CPU (the only CPU path
    with an lse).  A contract test replaces this function."""
    flex, create_block_mask, aux = _eager_ops()
    if device_type == "cpu":
        return flex, create_block_mask, aux
    return _compiled_flex(), create_block_mask, aux


def _mods(b, h, sq, sk, call: KernelCall, device, work):
    """``(mask_mod or None, its batch/head extents for create_block_mask, score_mod or None)``."""
    causal, key_offset, mask, softcap, alibi_slopes = call.causal, call.key_offset, call.mask, call.softcap, \
        call.alibi_slopes
    left, right = call.window
    rules = []
    if causal or left >= 0 or right >= 0:
        pos = torch.tensor([int(key_offset), left, right], dtype=torch.int64, device=device)
        if causal:
            rules.append(lambda m, n: n + pos[0] <= m)
        if left >= 0:
            rules.append(lambda m, n: n + pos[0] >= m - pos[1])
        if right >= 0:
            rules.append(lambda m, n: n + pos[0] <= m + pos[2])
    mb = mh = None
    if mask is not None:
        keep = mask.to(device=device, dtype=torch.bool)
        mb = b if keep.shape[0] != 1 else None      # None: the block mask broadcasts over that dim
        mh = h if keep.shape[1] != 1 else None
        keep = keep.expand(b, h, sq, sk)

    def mask_mod(bi, hi, m, n):
        ok = keep[bi, hi, m, n] if mask is not None else n >= 0
        for rule in rules:
            ok = ok & rule(m, n)
        return ok

    if not (softcap or alibi_slopes is not None):
        return (mask_mod if rules or mask is not None else None), (mb, mh), None
    # the scores are fp32 (fp64 for fp64 inputs) inside flex: captured scalars in that dtype
    cap = torch.tensor(float(softcap or 1.0), dtype=work, device=device)
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=work)
        slopes = slopes.view(1, h).expand(b, h) if slopes.dim() == 1 else slopes.view(b, h)
    off = torch.tensor(int(key_offset), dtype=torch.int64, device=device)

    def score_mod(score, bi, hi, m, n):
        if softcap:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[bi, hi] * (n + off - m).abs()
        return score

    return (mask_mod if rules or mask is not None else None), (mb, mh), score_mod


class FlexAttentionBackend(AttentionBackend):
    NAME = "flex"
    DESCRIPTION = ("torch FlexAttention: mask= and positions as a BlockMask, softcap/alibi as a score_mod; "
                   "CPU: uncompiled, forward with lse, no backward")
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})
    SUPPORTS_CAUSAL = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = True
    SUPPORTS_KEY_OFFSET = True      # the mods see global positions through a captured offset
    SUPPORTS_MASK = True            # indexed by the mask_mod
    SUPPORTS_GQA = True             # enable_gqa=True
    # Dk != Dv: flex checks only that q and k share a head dim (_validate_embed_dim); the Triton lowering takes a
    # value head dim of its own forward and backward (v_head_dim, "it is okay that the v_head_dim is different")
    SUPPORTS_DIFFERENT_V_DIM = True
    SUPPORTS_DROPOUT = False
    RETURNS_LSE = True              # return_aux=AuxRequest(lse=True), on both devices (see the module docstring)
    HAS_BACKWARD = True             # cuda only: LIMITS
    INPUT_LAYOUT = "last-dim-contiguous"
    LIMITS = (
        Limit("torch {torch}'s flex_attention has no backward on CPU (it raises for inputs that require grad); "
              "use attn_type='sdpa' for training on the CPU", uses=("backward",), devices=("cpu",),
              source=f"{SRC} torch/nn/attention/flex_attention.py _validate_device "
                     "(FlexAttention does not support backward on CPU)"),
        Limit("head_dim={head_dim}: flex's Triton kernels need a head dim of at least 16", devices=("cuda",),
              head_dims=(1, 15),
              source=f"{SRC} torch/_inductor/kernel/flex/flex_attention.py flex_attention lowering "
                     "(NYI: embedding dimension ... must be at least 16)"),
        Limit("fp64 on cuda: flex's Triton kernels are not checked in fp64 by this adapter; use fp32",
              uses=("fp64",), devices=("cuda",), source="not checked (no CUDA run of the adapter)"),
        Limit("bf16 on cpu with torch {torch}: its unfused flex_attention returns an lse off by up to 1e-2 in bf16 "
              "(torch 2.11.0 and later are within 1e-3); use torch >= 2.11, fp16/fp32, or attn_type='sdpa'",
              uses=("bf16",), devices=("cpu",), torch="<2.11",
              source="seen running torch 2.9.1's uncompiled flex_attention on the CPU (lse error 4e-3..9e-3 "
                     "against float64; 2.11.0 passes the same tests; 2.10 not tried)"),
    )
    INTERPRETER_CHECKED = (
        ("torch 2.13.0's flex_attention itself, uncompiled on the CPU: forward out and lse in fp64/fp32/bf16/fp16 "
         "through the adapter (mask=, empty rows, GQA, causal/window/alibi at key offsets, softcap, Sq != Sk, "
         "lengths past one 128-block) and LongContextAttention on one rank; backward refused",
         "the compiled CUDA kernels and their backward (the adapter's backward runs on torch's unfused flex "
         "with the CPU refusal lifted, a stand-in)"),
    )
    UPSTREAM_CHECKED = (
        ("CPU: uncompiled flex_attention returns out and a natural-log lse [B, H, Sq] (-inf and out 0 for rows "
         "without keys) in fp64/fp32/bf16/fp16, GQA through enable_gqa, lengths that are not multiples of 128; "
         "raises for inputs that require grad", "torch 2.13.0 (run here)"),
        ("CPU compiled kernel: no return_lse", f"{SRC} torch/_inductor/kernel/flex/flex_cpu.py"),
        ("a value head dim other than the query/key one: only q and k must match; the CUDA lowering sizes out and "
         "dv by v_head_dim", f"{SRC} torch/nn/attention/flex_attention.py _validate_embed_dim; "
                           "torch/_inductor/kernel/flex/flex_attention.py flex_attention, flex_attention_backward"),
        ("CUDA: base-2 stats scaled by ln 2, -inf lse for empty rows, indices bounded for partial blocks, "
         "head dim >= 16", f"{SRC} torch/nn/attention/flex_attention.py _finalize_outputs; "
                           "torch/_inductor/kernel/flex/templates/flex_attention.py.jinja, common.py.jinja"),
    )

    def kernel_forward(self, q, k, v, call: KernelCall):
        out, lse = self._run(q, k, v, call)
        return out.transpose(1, 2), normalize_lse(lse)

    def _run(self, q, k, v, call: KernelCall):
        """flex on [B, H, S, D] views: ``(out [B, H, Sq, D], lse [B, H, Sq])`` (natural log)."""
        b, sq, h, d = q.shape
        sk = k.shape[1]
        if sq == 0 or sk == 0:     # flex's kernels need both lengths > 0; no key: out 0, lse -inf
            dt = torch.float64 if q.dtype == torch.float64 else torch.float32
            return (q.new_zeros(b, h, sq, v.shape[-1]),
                    torch.full((b, h, sq), float("-inf"), dtype=dt, device=q.device))
        flex, create_block_mask, aux_request = flex_ops(device_type_of(q.device))
        mask_mod, (mb, mh), score_mod = _mods(b, h, sq, sk, call, q.device,
                                              torch.float64 if q.dtype == torch.float64 else torch.float32)
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, mb, mh, sq, sk, device=q.device)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        with warnings.catch_warnings():
            # the uncompiled CPU path warns once that it is unfused: that is the path chosen here on purpose
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, aux = flex(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, scale=call.scale,
                            enable_gqa=k.shape[2] != h, return_aux=aux_request(lse=True))
        if aux.lse is None:
            raise RuntimeError("flex: flex_attention returned no lse although return_aux asked for it")
        return out, aux.lse

    def kernel_backward(self, dout, q, k, v, out, lse, call: KernelCall):
        """flex's autograd on a recomputed block, re-weighted to the given ``out``/``lse``.

        The block's own result is ``(o_b, lse_b)``; with ``w = exp(lse_b - lse)`` (0 where
        ``lse`` is -inf) the global probabilities are ``w * P_b``.  Differentiating
        ``o_b`` with upstream ``w * dout`` and ``lse_b`` with upstream
        ``w * (dout . o_b - dout . out)`` gives ``dS = w P_b (dout . v - dout . out)``: the
        gradient of the full attention restricted to this block's keys."""
        with torch.enable_grad():
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            o_b, lse_b = self._run(qg, kg, vg, call)
            if not (o_b.requires_grad or lse_b.requires_grad):     # no key at all: nothing flows back
                return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            work = torch.float64 if q.dtype == torch.float64 else torch.float32
            lse_g = lse.to(work)
            lb = lse_b.detach().to(work)
            w = torch.where(torch.isneginf(lse_g) | torch.isneginf(lb), torch.zeros_like(lb), torch.exp(lb - lse_g))
            do = dout.transpose(1, 2).to(work)
            d_own = (do * o_b.detach().to(work)).sum(-1)
            d_glob = (do * out.transpose(1, 2).to(work)).sum(-1)
            g_out = (do * w.unsqueeze(-1)).to(o_b.dtype)
            g_lse = (w * (d_own - d_glob)).to(lse_b.dtype)
            dq, dk, dv = torch.autograd.grad((o_b, lse_b), (qg, kg, vg), (g_out, g_lse), allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g.to(x.dtype)
                     for g, x in ((dq, q), (dk, k), (dv, v)))
