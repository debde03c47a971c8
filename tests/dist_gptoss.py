"""A tiny gpt-oss (attention sinks, alternating sliding-window layers, MoE) built from a
config, sequence-parallel against one process: functions for a WorkerPool (tests/mp.py)."""
from __future__ import annotations

import copy

import torch

import usp_hal
from tests.dist_cases import get_mesh

VOCAB = 256


def tiny_gpt_oss(seed: int = 0, window: int = 8):
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                       vocab_size=VOCAB, max_position_embeddings=256, sliding_window=window,
                       layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:      # sinks large enough to matter
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.set_attn_implementation("eager")       # gpt-oss has no sdpa path in transformers: the reference
    return model


def gpt_oss_training(U=1, R=2, layout="zigzag", steps=3, B=2, S=40, seed=0, lr=1e-3):
    """Logits and a few AdamW steps, sequence-parallel vs one process; the sinks' effect."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_gptoss_u{U}r{R}_{layout}", mesh=mesh, layout=layout, attn_type="sdpa",
                        enable=True)
    ref = tiny_gpt_oss(seed)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    with torch.no_grad():
        local = model(**usp.shard_batch({"input_ids": ids}, mesh, layout)).logits
        logits = usp_hal.unshard(local, layout=layout, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for _ in range(steps):
        out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout))
        out.loss.backward()
        losses.append(float(usp.sync_gradients(model, mesh, out.loss)))
        if first_grads is None:
            first_grads = [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]
        opt.step()
        opt.zero_grad()
    if mesh.sp_rank != 0:
        return {"losses": losses}
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
        no_sinks = copy.deepcopy(ref)
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        sink_effect = float((no_sinks(input_ids=ids).logits - ref_logits).abs().max())
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses, ref_grads = [], None
    for _ in range(steps):
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        ref_losses.append(out.loss.item())
        if ref_grads is None:
            ref_grads = [layer.self_attn.sinks.grad.clone() for layer in ref.model.layers]
        ropt.step()
        ropt.zero_grad()
    sinks_diff = max(float((a.self_attn.sinks - b.self_attn.sinks).abs().max())
                     for a, b in zip(model.model.layers, ref.model.layers))
    return {"losses": losses, "logits_diff": float((logits - ref_logits).abs().max()),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())),
            "sinks_diff": sinks_diff, "sink_effect": sink_effect,
            "sinks_grad_diff": max(float((a - b).abs().max()) for a, b in zip(first_grads, ref_grads)),
            "sinks_grad_scale": max(float(b.abs().max()) for b in ref_grads),
            "sinks_moved": max(float((a.self_attn.sinks - b.self_attn.sinks).abs().max())
                               for a, b in zip(ref.model.layers, tiny_gpt_oss(seed).model.layers))}


def gpt_oss_generate(U=1, R=2, layout="zigzag", B=2, S=20, new=5, seed=0):
    """Greedy generate() with the sharded KV cache (sinks in prefill and in every decode
    step, a sliding-window layer) against one process; the tokens on every rank."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_gptoss_gen_u{U}r{R}_{layout}", mesh=mesh, layout=layout, attn_type="sdpa",
                        enable=True)
    ref = tiny_gpt_oss(seed, window=6).eval()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    g = torch.Generator().manual_seed(seed + 11)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    with torch.no_grad():
        got = model.generate(**usp.shard_batch({"input_ids": ids}, mesh, layout), max_new_tokens=new,
                             do_sample=False)
    res = {"tokens": got[:, -new:].tolist()}
    if mesh.sp_rank == 0:
        with torch.no_grad():
            want = ref.generate(input_ids=ids, max_new_tokens=new, do_sample=False)
            no_sinks = copy.deepcopy(ref)
            for layer in no_sinks.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
            other = no_sinks.generate(input_ids=ids, max_new_tokens=new, do_sample=False)
        res.update(ref_tokens=want[:, -new:].tolist(), no_sink_tokens=other[:, -new:].tolist())
    return res
