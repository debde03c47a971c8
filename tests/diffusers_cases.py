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


def qwen_inputs(B=2, h=4, w=5, text_len=7, seed=0, text_pad=0):
    """``text_pad``: a text mask (``encoder_hidden_states_mask``, which QwenImagePipeline passes)
    with the last ``text_pad`` tokens of row 1 and token 1 of row 0 padding; the processor
    makes it a key mask over the joint [text; image] sequence."""
    g = torch.Generator().manual_seed(seed + 7)
    mask = None
    if text_pad:
        mask = torch.ones(B, text_len, dtype=torch.long)
        mask[1, text_len - text_pad:] = 0
        mask[0, 1] = 0
    return dict(hidden_states=torch.randn(B, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g), encoder_hidden_states_mask=mask,
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
    # every output: MiniMax-H3 returns the video and the audio velocity
    out = torch.cat([o.flatten() for o in model(**x, return_dict=False)])
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 3))
    (out * weight).sum().backward()
    grads = {k: x[k].grad for k in grad_keys}
    if mesh is not None:     # per-rank partials: their sum over the group is the gradient
        for g in grads.values():
            dist.all_reduce(g, group=mesh.sp_group)
    return out.detach(), grads


def model_case(name: str, U=2, R=1, seed=0, control=None, allow_unverified=False, **input_kw):
    """``name``'s tiny model under parallelize() vs one process: output, summed input
    gradients, synced parameter gradients.  ``control="local_cross"``: cross-attention to
    sharded keys attends to the local shard only (must be far off: the gather matters)."""
    from usp_hal.integrations import diffusers as usp

    build, make_inputs, grad_keys = MODELS[name]
    mesh = get_mesh(U, R)
    ref = build(seed)
    model = copy.deepcopy(ref)
    inputs = make_inputs(seed=seed, **input_kw)
    handle = usp.parallelize(model, mesh, attn_type="sdpa", allow_unverified=allow_unverified)
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


def mask_refusals(U=1, R=2, text_len=7, seed=0):
    """Masks over the sharded joint sequence that are not key padding, refused on every rank
    before any data moves (tiny Flux, whose processor passes ``attention_mask`` as given): a
    bias, padding that differs between heads, a per-query mask, a mask on one rank only; and
    key padding given per rank as local ``[B, 1, 1, S_local]`` masks runs and matches one
    process with the same padding."""
    import usp_hal
    from tests.dist_cases import error_of
    from tests.integration_cases import flux_inputs, tiny_flux
    from usp_hal.integrations import diffusers as usp

    mesh = get_mesh(U, R)
    ref = tiny_flux(seed)
    model = copy.deepcopy(ref)
    inputs = flux_inputs(text_len, seed=seed)
    n_img = inputs["hidden_states"].shape[1]
    local = [usp_hal.shard(torch.zeros(1, n), mesh=mesh).shape[1] for n in (text_len, n_img)]
    S = sum(local)

    def run(mask):
        return model(**inputs, joint_attention_kwargs={"attention_mask": mask}).sample

    res = {}
    handle = usp.parallelize(model, mesh, attn_type="sdpa")
    try:
        with torch.no_grad():
            bias = torch.zeros(2, 1, 1, S)
            bias[..., 0] = -0.5
            res["bias"] = error_of(lambda: run(bias))
            heads = torch.ones(2, 4, 1, S, dtype=torch.bool)
            heads[:, 1, 0, 0] = False
            res["per_head"] = error_of(lambda: run(heads))
            res["per_query"] = error_of(lambda: run(torch.ones(2, 1, S, S, dtype=torch.bool)))
            one = torch.ones(2, 1, 1, S, dtype=torch.bool) if mesh.sp_rank == 0 else None
            res["one_rank"] = error_of(lambda: run(one))
            # key padding: text token 1 of row 0 excluded, as local masks; reference: the same
            # padding as a global mask over [text; image] on one process
            pad = torch.ones(2, text_len + n_img, dtype=torch.bool)
            pad[0, 1] = False
            mine = torch.cat([usp_hal.shard(pad[:, :text_len], mesh=mesh), usp_hal.shard(pad[:, text_len:], mesh=mesh)],
                             dim=1)
            got = run(mine[:, None, None, :])
    finally:
        handle.remove()
    if mesh.sp_rank != 0:
        return res
    with torch.no_grad():
        want = ref(**inputs, joint_attention_kwargs={"attention_mask": pad[:, None, None, :]}).sample
        unpadded = ref(**inputs).sample
    res["padding_diff"] = _max_diff(got, want)
    res["padding_effect"] = _max_diff(unpadded, want)
    return res


# ----------------------------------------------------------------------------- pipelines end to end
# Tiny components from configs (diffusers' own fast-test configs, tests/pipelines/*/test_*.py);
# no tokenizer or text encoder can be loaded offline, so the prompts come as embeddings with
# the masks a tokenizer gives two prompts of different lengths (padded to the longer one).
def _text(B, n, dim, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, n, dtype=torch.long)
    for i, k in enumerate(lengths):
        mask[i, :k] = 1
    return torch.randn(B, n, dim, generator=g), mask


def _ltx_pipe():
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline
    torch.manual_seed(0)
    transformer = tiny_ltx_pipeline_transformer()
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                spatio_temporal_scaling=(True, True, False, False), layers_per_block=(1, 1, 1, 1, 1),
                                patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                       transformer=transformer)
    emb, mask = _text(2, 9, 32, (9, 5), 1)
    nemb, nmask = _text(2, 9, 32, (2, 3), 2)
    call = dict(prompt_embeds=emb, prompt_attention_mask=mask, negative_prompt_embeds=nemb,
                negative_prompt_attention_mask=nmask, height=32, width=32, num_frames=9, num_inference_steps=2)
    return pipe, call, lambda out: out.frames


def tiny_ltx_pipeline_transformer():
    from diffusers import LTXVideoTransformer3DModel
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                      num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                                      num_layers=1, caption_channels=32)


def _qwen_pipe():
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    torch.manual_seed(0)
    transformer = tiny_qwen()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                             transformer=transformer)
    emb, mask = _text(2, 7, 16, (7, 4), 1)
    nemb, nmask = _text(2, 7, 16, (3, 2), 2)
    # default true_cfg_scale (4.0) with a negative prompt: two transformer calls per step
    call = dict(prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=nemb,
                negative_prompt_embeds_mask=nmask, height=48, width=40, num_inference_steps=2)
    return pipe, call, lambda out: out.images


def _flux_pipe():
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    torch.manual_seed(0)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    emb, _ = _text(2, 9, 32, (9, 9), 1)
    pooled = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    call = dict(prompt_embeds=emb, pooled_prompt_embeds=pooled, height=16, width=24, num_inference_steps=2)
    return pipe, call, lambda out: out.images


def _wan_pipe():
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    transformer = tiny_wan_pipeline_transformer()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    emb, _ = _text(2, 9, 16, (9, 9), 1)
    nemb, _ = _text(2, 9, 16, (9, 9), 2)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=nemb, height=16, width=16, num_frames=9,
                num_inference_steps=2)
    return pipe, call, lambda out: out.frames


def tiny_wan_pipeline_transformer():
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                                 out_channels=16, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


PIPELINES = {"ltx": _ltx_pipe, "qwen": _qwen_pipe, "flux": _flux_pipe, "wan": _wan_pipe}


def pipeline_case(name: str, U=1, R=2):
    """``name``'s pipeline with tiny components under parallelize(pipe.transformer) on every
    rank vs the same pipeline on one process: the denoised latents (``output_type="latent"``,
    every transformer call of the loop; the VAE decode that follows does not involve usp-hal
    and takes most of the time on a CPU)."""
    from usp_hal.integrations import diffusers as usp

    mesh = get_mesh(U, R)
    pipe, call, result = PIPELINES[name]()
    pipe.set_progress_bar_config(disable=True)
    ref_transformer = copy.deepcopy(pipe.transformer)
    handle = usp.parallelize(pipe.transformer, mesh, attn_type="sdpa")
    try:
        with torch.no_grad():
            got = result(pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)))
    finally:
        handle.remove()
    if mesh.sp_rank != 0:
        return {}
    pipe.transformer = ref_transformer
    with torch.no_grad():
        want = result(pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)))
    res = {"diff": _max_diff(got, want), "scale": float(want.abs().max()), "shape": list(want.shape)}
    masks = [k for k in call if k.endswith("mask")]
    if masks:       # the padding matters: without it the result is another one
        with torch.no_grad():
            unpadded = result(pipe(**{**call, **{k: torch.ones_like(call[k]) for k in masks}}, output_type="latent",
                                   generator=torch.Generator().manual_seed(0)))
        res["mask_effect"] = _max_diff(unpadded, want)
    return res


def tiny_flux2(seed=0):
    from diffusers import Flux2Transformer2DModel
    torch.manual_seed(seed)
    return Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                   timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4))


def flux2_inputs(B=2, side=5, text_len=7, seed=0):
    """Flux.2's 4-axis position ids ``[B, S, 4]`` (the plan splits them with the tokens); the
    text ids are distinct positions so a wrong text split would show."""
    g = torch.Generator().manual_seed(seed + 7)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img = torch.stack([torch.zeros_like(rows), rows, cols, torch.zeros_like(rows)], -1).reshape(1, -1, 4)
    txt = torch.stack([torch.zeros(text_len), torch.zeros(text_len), torch.zeros(text_len),
                       torch.arange(text_len)], -1)[None]
    return dict(hidden_states=torch.randn(B, side * side, 4, generator=g),
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g),
                timestep=torch.rand(B, generator=g), guidance=torch.full((B,), 3.5),
                img_ids=img.expand(B, -1, -1).float(), txt_ids=txt.expand(B, -1, -1).float())


def tiny_chronoedit(seed=0):
    from diffusers import ChronoEditTransformer3DModel
    torch.manual_seed(seed)
    return ChronoEditTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32, image_dim=8, added_kv_proj_dim=24)


def chronoedit_inputs(B=2, frames=2, side=6, text_len=7, seed=0):
    g = torch.Generator().manual_seed(seed + 7)
    return dict(hidden_states=torch.randn(B, 4, frames, side, side, generator=g),
                timestep=torch.rand(B, generator=g) * 1000,
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g),
                encoder_hidden_states_image=torch.randn(B, 5, 8, generator=g))


MODELS.update({
    "flux2": (tiny_flux2, flux2_inputs, ("hidden_states", "encoder_hidden_states")),
    "chronoedit": (tiny_chronoedit, chronoedit_inputs, ("hidden_states", "encoder_hidden_states",
                                                        "encoder_hidden_states_image")),
})


def tiny_minimax_h3(seed=0):
    from diffusers import MiniMaxH3Transformer3DModel
    torch.manual_seed(seed)
    # 2 * 3 * rope_freq_dim = 12 of the 16 head channels rotated, 4 passed through
    return MiniMaxH3Transformer3DModel(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2,
                                       num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=4,
                                       patch_size=(1, 2, 2), text_dim=16, freq_dim=16, time_embed_hidden_dim=32,
                                       time_embed_dim=16, rope_freq_dim=2)


def minimax_h3_inputs(B=2, frames=2, side=4, audio_latents=3, text_len=7, vision_rows=2, seed=0):
    """The packed ``[text | keyframe | audio | video]`` layout of MiniMax-H3's t2va/fl2va task,
    built by its pipeline's own layout and timestep steps (one first-frame keyframe: conditioning
    video rows at another timestep; ``vision_rows`` text rows tagged video, as a keyframe's vision
    block is; stereo audio packed channel-major).  Every per-row tensor is over the whole packed
    sequence: the plan splits them inside the model, after the rows are scattered."""
    from diffusers.modular_pipelines.minimax_h3 import before_denoise as steps
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as mp

    tags = torch.full((text_len,), mp.MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    tags[1:1 + vision_rows] = mp.MINIMAX_H3_VIDEO_TAG
    position_ids, token_tags, video_indices, audio_indices, text_indices, cond_video, cond_audio = \
        steps.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags, frames, side, side, audio_latents, (1, 2, 2), mp.MINIMAX_H3_AUDIO_CHANNELS,
            mp.MINIMAX_H3_AUDIO_TAG, mp.MINIMAX_H3_VIDEO_TAG, keyframe_anchors=("first",))
    timestep, timestep_indices = steps.MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, cond_video, cond_audio, text_len, 0.7, 0.4, 0.999, 1.0)
    g = torch.Generator().manual_seed(seed + 7)
    return dict(hidden_states=torch.randn(B, video_indices.numel(), 16, generator=g),
                audio_hidden_states=torch.randn(B, audio_indices.numel(), 4, generator=g),
                encoder_hidden_states=torch.randn(B, text_len, 16, generator=g),
                timestep=timestep, timestep_indices=timestep_indices, token_tags=token_tags,
                position_ids=position_ids, video_indices=video_indices, audio_indices=audio_indices,
                text_indices=text_indices)


MODELS["minimax_h3"] = (tiny_minimax_h3, minimax_h3_inputs,
                        ("hidden_states", "audio_hidden_states", "encoder_hidden_states"))


def short_text_case(name: str = "qwen", U=1, R=2, text_len=1, seed=0):
    """``name``'s tiny model under parallelize() with a text of ``text_len`` tokens: the error
    this rank raised (None: it ran)."""
    from usp_hal.integrations import diffusers as usp
    build, make_inputs, grad_keys = MODELS[name]
    model = build(seed)
    handle = usp.parallelize(model, get_mesh(U, R), attn_type="sdpa")
    try:
        with torch.no_grad():
            model(**make_inputs(seed=seed, text_len=text_len))
    except ValueError as exc:
        return str(exc)
    finally:
        handle.remove()
    return None
