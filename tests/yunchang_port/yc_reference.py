"""The reference the ported yunchang scripts compare against, in place of flash_attn's kernels
(which need CUDA): torch's scaled_dot_product_attention in float64 on the global tensors, cast
back to the input dtype, with flash_attn's call signatures (``flash_attn_func``,
``flash_attn_qkvpacked_func``: ``[B, S, H, D]`` in, the output or ``(out, lse, None)`` out).
Gradients flow to the inputs through the casts, so ``out.backward(dout)`` leaves the float64
gradients, rounded to the input dtype, in ``q.grad`` etc."""
import math

import torch
import torch.nn.functional as F


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    if dropout_p or softcap or alibi_slopes is not None or tuple(window_size) != (-1, -1):
        raise NotImplementedError("the float64 reference covers what the ported scripts ask: no dropout, "
                                  "softcap, alibi or window")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))       # [B, H, S, D]
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale,
                                         enable_gqa=kd.shape[1] != qd.shape[1])
    out = out.transpose(1, 2).to(q.dtype)
    if not return_attn_probs:
        return out
    with torch.no_grad():
        rep = qd.shape[1] // kd.shape[1]
        scores = qd @ kd.repeat_interleave(rep, dim=1).transpose(-1, -2) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            scores.masked_fill_(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1).float()                 # [B, H, S]
    return out, lse, None


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)
