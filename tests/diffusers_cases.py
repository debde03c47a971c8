"""Rank functions for diffusers transformers beyond Flux under ``parallelize`` (tests/
test_integration_diffusers_models.py): tiny random configs of every verified model, forward
and backward against one process in the same worker (sequence-parallel rank 0).

Input gradients are per-rank partials (each rank's tokens' part, also for the inputs every
rank holds whole, such as Wan's text); their sum over the group is compared.  Parameter
gradients are compared after ``sync_gradients``."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.dist_cases import get_mesh
from tests.integration_cases import _max_diff


def tiny_wan(seed=0):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                 rope_max_seq_len=32)


def wan_inputs(B=2, frames=2, side=6, text_len=7, seed=0, timestep_dims=1):
    g = torch.Generator().manual_seed(seed + 7)
    tokens = frames * (side // 2) ** 2
    t = torch.rand(B, generator=g) * 1000 if timestep_dims == 1 else torch.rand(B, tokens, generator=g) * 1000
    return dict(hidden_states=torch.randn(B, 4, frames, side, side, generator=g), timestep=t,
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g))


def tiny_qwen(seed=0):
    from diffusers import QwenImageTransformer2DModel
    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                       axes_dims_rope=(8, 4, 4))


def qwen_inputs(B=2, h=4, w=5, text_len=7, seed=0):
    g = torch.Generator().manual_seed(seed + 7)
    return dict(hidden_states=torch.randn(B, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g),
                timestep=torch.rand(B, generator=g), img_shapes=[[(1, h, w)]] * B)


def tiny_ltx(seed=0):
    from diffusers import LTXVideoTransformer3DModel
    torch.manual_seed(seed)
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
                                      cross_attention_dim=16, num_layers=2, caption_channels=16)


def ltx_inputs(B=2, frames=2, h=3, w=4, text_len=7, seed=0, text_pad=0):
    """``text_pad``: the last ``text_pad`` text tokens of row 1 are padding (the text mask that
    LTXPipeline always passes)."""
    g = torch.Generator().manual_seed(seed + 7)
    mask = None
    if text_pad:
        mask = torch.ones(B, text_len, dtype=torch.long)
        mask[1, text_len - text_pad:] = 0
    return dict(hidden_states=torch.randn(B, frames * h * w, 8, generator=g),
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g),
                timestep=torch.rand(B, generator=g) * 1000, encoder_attention_mask=mask,
                num_frames=frames, height=h, width=w)


MODELS = {
    "wan": (tiny_wan, wan_inputs, ("hidden_states", "encoder_hidden_states")),
    "qwen": (tiny_qwen, qwen_inputs, ("hidden_states", "encoder_hidden_states")),
    "ltx": (tiny_ltx, ltx_inputs, ("hidden_states", "encoder_hidden_states")),
}


def _run(model, inputs, grad_keys, seed, mesh=None):
    x = {k: (v.clone().requires_grad_(k in grad_keys) if isinstance(v, torch.Tensor) else v)
         for k, v in inputs.items()}
    out = model(**x, return_dict=False)[0]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 3))
    (out * weight).sum().backward()
    grads = {k: x[k].grad for k in grad_keys}
    if mesh is not None:     # per-rank partials: their sum over the group is the gradient
        for g in grads.values():
            dist.all_reduce(g, group=mesh.sp_group)
    return out.detach(), grads


def model_case(name: str, U=2, R=1, seed=0, control=None, **input_kw):
    """``name``'s tiny model under parallelize() vs one process: output, summed input
    gradients, synced parameter gradients.  ``control="local_cross"``: cross-attention to
    sharded keys attends to the local shard only (must be far off: the gather matters)."""
    from usp_hal.integrations import diffusers as usp

    build, make_inputs, grad_keys = MODELS[name]
    mesh = get_mesh(U, R)
    ref = build(seed)
    model = copy.deepcopy(ref)
    inputs = make_inputs(seed=seed, **input_kw)
    handle = usp.parallelize(model, mesh, attn_type="sdpa")
    cross = {"calls": 0}
    original = usp._cross_attention
    if control == "local_cross":
        def local_only(ctx, q, k, v, p, s, mask=None):
            cross["calls"] += 1
            return usp._local_attention(q, k, v, p, s, mask)
        usp._cross_attention = local_only
    else:
        def counted(*a):
            cross["calls"] += 1
            return original(*a)
        usp._cross_attention = counted
    try:
        out, grads = _run(model, inputs, grad_keys, seed, mesh)
        usp.sync_gradients(model, mesh)
    finally:
        usp._cross_attention = original
        handle.remove()
    params = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if mesh.sp_rank != 0:
        return {}
    rout, rgrads = _run(ref, inputs, grad_keys, seed)
    rparams = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"out_diff": _max_diff(out, rout), "out_scale": float(rout.abs().max()),
            "input_grad_diff": max(_max_diff(grads[k], rgrads[k]) for k in grads),
            "input_grad_scale": max(float(rgrads[k].abs().max()) for k in grads),
            "param_grad_diff": max(_max_diff(params[n], rparams[n]) for n in rparams),
            "param_grad_scale": max(float(g.abs().max()) for g in rparams.values()),
            "params_compared": len(rparams), "params_missing": sorted(set(rparams) - set(params)),
            "cross_calls": cross["calls"]}
