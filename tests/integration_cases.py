"""Functions that run on every rank of a WorkerPool for the transformers and diffusers
integrations (see tests/mp.py).  Each builds a tiny randomly initialised model from a config
(no downloads), runs it sequence-parallel, and computes the single-process reference in the
same worker (on sequence-parallel rank 0 only, so that 4 ranks on 2 cores stay fast)."""
from __future__ import annotations

import ast
import copy
import difflib
from pathlib import Path

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import error_of, get_mesh

VOCAB = 256
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


# ----------------------------------------------------------------------------- transformers
def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=256, attention_dropout=0.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.set_attn_implementation("sdpa")
    return model


def _batches(steps: int, B: int, S: int, seed: int):
    """The same random batch every step: the model memorises it, so the loss falls by a lot
    over 20 steps and a wrong gradient cannot hide in noise."""
    g = torch.Generator().manual_seed(seed + 1000)
    return [torch.randint(0, VOCAB, (B, S), generator=g)] * steps


def llama_training(U=2, R=1, layout="zigzag", steps=20, B=2, S=50, seed=0, lr=1e-3, low_memory=False,
                   tiled_loss=0):
    """Logits and 20 AdamW steps of a tiny GQA Llama, sequence-parallel vs single-process.
    Returns (on every rank) the global losses; rank 0 adds the differences to the reference.
    ``low_memory``: registered with ``register(..., low_memory=...)``; ``tiled_loss``: the
    sequence-parallel model's loss in tiles of that many tokens (the reference's is untiled)."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_u{U}r{R}_{layout}{'_low' if low_memory else ''}", mesh=mesh, layout=layout,
                        attn_type="sdpa", low_memory=low_memory, enable=True)
    ref = tiny_llama(seed)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    data = _batches(steps, B, S, seed)

    with torch.no_grad():
        local = model(**usp.shard_batch({"input_ids": data[0]}, mesh, layout)).logits
        logits = usp_hal.unshard(local, layout=layout, mesh=mesh)

    if tiled_loss:
        from usp_hal.integrations.training.tiled_loss import TiledLogits, enable_tiled_loss
        enable_tiled_loss(model, tiled_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in data:
        out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout))
        out.loss.backward()
        losses.append(float(usp.sync_gradients(model, mesh, out.loss)))
        opt.step()
        opt.zero_grad()
    res = {"losses": losses, "module_low_memory": usp._FUNCTIONS[name]._module_for(mesh).low_memory}
    if tiled_loss:
        res["tiled"] = isinstance(out.logits, TiledLogits)
    if mesh.sp_rank != 0:
        return res

    with torch.no_grad():
        ref_logits = ref(input_ids=data[0]).logits
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses = []
    for ids in data:
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        ref_losses.append(out.loss.item())
        ropt.step()
        ropt.zero_grad()
    res.update(ref_losses=ref_losses, logits_diff=_max_diff(logits, ref_logits),
               logits_scale=float(ref_logits.abs().max()),
               loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
               param_diff=max(_max_diff(p, q) for p, q in zip(model.parameters(), ref.parameters())),
               loss_change=ref_losses[0] - ref_losses[-1])
    return res


def llama_checkpointing(U=1, R=2, layout="zigzag", B=2, S=50, seed=0):
    """Activation checkpointing recomputes the attention in backward (more collectives inside
    backward, same on every rank): loss and gradients against single-process."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_u{U}r{R}_{layout}", mesh=mesh, layout=layout, attn_type="sdpa", enable=True)
    ref = tiny_llama(seed)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    ids = _batches(1, B, S, seed)[0]
    out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout))
    out.loss.backward()
    loss = usp.sync_gradients(model, mesh, out.loss).item()
    if mesh.sp_rank != 0:
        return {}
    rout = ref(input_ids=ids, labels=ids)
    rout.loss.backward()
    return {"loss_diff": abs(loss - rout.loss.item()), "checkpointing": bool(model.model.gradient_checkpointing),
            "grad_diff": max(_max_diff(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))}


def llama_label_control(U=1, R=2, layout="zigzag", B=2, S=50, seed=0):
    """The loss with shard_batch's globally shifted labels, and with labels sharded first and
    shifted inside each shard (what a model does with a plain ``labels`` shard): the second
    must differ from single-process, proving the loss comparison can fail.  Also: a right-padded
    batch without mask (pads labelled -100) against single-process with the padding mask."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_u{U}r{R}_{layout}", mesh=mesh, layout=layout, attn_type="sdpa", enable=True)
    model = tiny_llama(seed)
    ref_loss = model(input_ids=_batches(1, B, S, seed)[0], labels=_batches(1, B, S, seed)[0]).loss.item()
    model.set_attn_implementation(name)
    ids = _batches(1, B, S, seed)[0]
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout)
    with torch.no_grad():
        right = model(**batch).loss
        wrong = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      labels=usp_hal.shard(ids, layout=layout, mesh=mesh),
                      num_items_in_batch=batch["num_items_in_batch"]).loss
    # right padding: no attention_mask and labels -100 on the pads, against single-process
    # attention with the padding mask (causal: real tokens never see the pads after them)
    padded = ids.clone()
    padded[1, -7:] = 0
    labels = padded.clone()
    labels[1, -7:] = -100
    mask = torch.ones_like(padded)
    mask[1, -7:] = 0
    with torch.no_grad():
        padded_loss = model(**usp.shard_batch({"input_ids": padded, "labels": labels}, mesh, layout)).loss
    ref_model = tiny_llama(seed)
    ref_padded = ref_model(input_ids=padded, labels=labels, attention_mask=mask).loss.item()
    both = torch.stack([right, wrong, padded_loss])
    dist.all_reduce(both, group=mesh.sp_group)
    return {"right_diff": abs(float(both[0]) - ref_loss), "wrong_diff": abs(float(both[1]) - ref_loss),
            "right_padding_diff": abs(float(both[2]) - ref_padded)}


def llama_refusals(U=1, R=2, B=2, S=24, seed=0):
    """Calls the transformers integration must refuse, each on every rank together (a rank that
    went on alone would hang the next collective, and the case would time out)."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    rank = mesh.sp_rank
    name = usp.register(f"usp_hal_test_u{U}r{R}_zigzag", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    model = tiny_llama(seed, num_hidden_layers=2)
    model.set_attn_implementation(name)
    model.eval()
    ids = _batches(1, B, S, seed)[0]
    batch = usp.shard_batch({"input_ids": ids}, mesh, "zigzag")
    local_len = batch["input_ids"].shape[1]
    res = {}
    with torch.no_grad():
        res["no_position_ids"] = error_of(lambda: model(input_ids=batch["input_ids"]))
        mask = torch.ones(B, local_len, dtype=torch.long)
        if rank == 1:
            mask[0, 0] = 0       # padding on one rank only
        res["padding_mask_one_rank"] = error_of(lambda: model(**batch, attention_mask=mask))
        res["ones_mask_ok"] = error_of(lambda: model(**batch, attention_mask=torch.ones(B, local_len)))
        mask4 = torch.ones(B, 1, local_len, local_len, dtype=torch.bool).tril()
        res["mask_4d"] = error_of(lambda: model(**batch, attention_mask=mask4))
        padded = torch.ones(B, S, dtype=torch.long)
        padded[1, -3:] = 2       # padding is supported (tests/test_integration_generate.py); other values are not
        res["shard_batch_padding"] = error_of(
            lambda: usp.shard_batch({"input_ids": ids, "attention_mask": padded}, mesh, "zigzag"))
        basic = usp.shard_batch({"input_ids": ids}, mesh, "basic")
        res["layout_mismatch"] = error_of(lambda: model(**basic))
        own = ids + rank
        res["different_batches"] = error_of(lambda: usp.shard_batch({"input_ids": own}, mesh, "zigzag"))

        def generate_step():
            out = model(**batch, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            model(input_ids=nxt, position_ids=torch.full((B, 1), S), past_key_values=out.past_key_values,
                  use_cache=True)
        res["kv_cache"] = error_of(generate_step)
        res["attentions"] = error_of(lambda: model(**batch, output_attentions=True))
        # packed sequences: boundaries that disagree, half of the collator's pair, positions that
        # restart per document handed to the model without their boundaries
        cu = (0, 9, 24)
        t = torch.tensor(cu, dtype=torch.int32)
        res["packed_disagree"] = error_of(lambda: usp.shard_batch(
            {"input_ids": ids, "cu_seq_lens_q": t, "cu_seq_lens_k": t}, mesh, "zigzag", cu_seqlens=(0, 10, 24)))
        res["packed_half"] = error_of(lambda: usp.shard_batch({"input_ids": ids, "cu_seq_lens_q": t}, mesh,
                                                                "zigzag"))
        packed = usp.shard_batch({"input_ids": ids}, mesh, "zigzag", cu_seqlens=cu)
        res["packed_without_boundaries"] = error_of(
            lambda: model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]))
        res["packed_ok"] = error_of(lambda: model(**packed))
    res["unknown_attn_type"] = error_of(lambda: usp.register("usp_hal_test_bad", attn_type="no_such_kernel"))
    drop = tiny_llama(seed, num_hidden_layers=2, attention_dropout=0.1)
    drop.set_attn_implementation(name)
    drop.train()
    res["dropout"] = error_of(lambda: drop(**batch))
    with torch.no_grad():     # the group still works after every refusal
        local = model(**batch).logits
        ref = tiny_llama(seed, num_hidden_layers=2).eval()(input_ids=ids).logits
    res["after_refusals_diff"] = _max_diff(usp_hal.unshard(local, layout="zigzag", mesh=mesh), ref)
    return res


def llama_dp_training(U=2, R=1, steps=5, B=2, S=32, seed=0, lr=1e-3):
    """Two data-parallel replicas of a sequence-parallel group (4 ranks, U=2): each replica trains
    on its own batch; sync_gradients sums over the group and averages over replicas.  The
    reference trains on both batches at once (equal token counts, so the mean loss is the same)."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    replica = dist.get_rank() // mesh.sp_size
    name = usp.register(f"usp_hal_test_u{U}r{R}_zigzag", mesh=mesh, layout="zigzag", attn_type="sdpa", enable=True)
    ref = tiny_llama(seed)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    data = [_batches(1, B, S, seed + i)[0] for i in range(mesh.dp_degree)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = model(**usp.shard_batch({"input_ids": data[replica], "labels": data[replica]}, mesh, "zigzag"))
        out.loss.backward()
        losses.append(usp.sync_gradients(model, mesh, out.loss).item())
        opt.step()
        opt.zero_grad()
    if dist.get_rank() != 0:
        return {"losses": losses}
    both = torch.cat(data)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses = []
    for _ in range(steps):
        out = ref(input_ids=both, labels=both)
        out.loss.backward()
        ref_losses.append(out.loss.item())
        ropt.step()
        ropt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max(_max_diff(p, q) for p, q in zip(model.parameters(), ref.parameters()))}


def mistral_window(U=1, R=2, layout="zigzag", B=2, S=40, window=8, seed=0):
    """A tiny Mistral with a causal sliding window shorter than the sequence: logits and input
    gradients against single-process, plus the difference the window makes (must be large)."""
    from transformers import MistralConfig, MistralForCausalLM

    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_u{U}r{R}_{layout}", mesh=mesh, layout=layout, attn_type="sdpa", enable=True)
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=window)
    torch.manual_seed(seed)
    ref = MistralForCausalLM(MistralConfig(**cfg))
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    ids = _batches(1, B, S, seed)[0]
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout)
    out = model(**batch)
    out.loss.backward()
    loss = usp.sync_gradients(model, mesh, out.loss)
    logits = usp_hal.unshard(out.logits.detach(), layout=layout, mesh=mesh)
    if mesh.sp_rank != 0:
        return {}
    rout = ref(input_ids=ids, labels=ids)
    rout.loss.backward()
    with torch.no_grad():
        full = copy.deepcopy(ref)
        full.config.sliding_window = None
        for layer in full.model.layers:
            layer.self_attn.config.sliding_window = None
        no_window = full(input_ids=ids).logits
    return {"logits_diff": _max_diff(logits, rout.logits), "loss_diff": abs(loss.item() - rout.loss.item()),
            "grad_diff": max(_max_diff(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
            "window_effect": _max_diff(no_window, rout.logits)}


def run_example(name: str, **kwargs):
    """Load examples/<name>.py and call its main() (under the pool's process group)."""
    import importlib.util
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(**kwargs)


def example_pair(sp: str, single: str):
    """The sequence-parallel example on every rank; its single-process twin on rank 0."""
    got = run_example(sp)
    if dist.get_rank() != 0:
        return {}
    want = run_example(single)
    if isinstance(got, list):
        return {"max_diff": max(abs(a - b) for a, b in zip(got, want)), "first": want[0], "last": want[-1]}
    return {"max_diff": _max_diff(got, want), "scale": float(want.abs().max())}


# ----------------------------------------------------------------------------- diffusers
def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))


def flux_inputs(text_len: int, B: int = 2, side: int = 6, seed: int = 0):
    """Random Flux inputs: side x side image tokens, text_len text tokens.  The text ids are
    distinct positions (pipelines use zeros) so that a wrong text split would show."""
    g = torch.Generator().manual_seed(seed + 7)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    txt_ids = torch.stack([torch.arange(text_len)] * 3, dim=-1).float() + 0.5
    return dict(hidden_states=torch.randn(B, side * side, 8, generator=g),
                encoder_hidden_states=torch.randn(B, text_len, 32, generator=g),
                pooled_projections=torch.randn(B, 16, generator=g),
                timestep=torch.rand(B, generator=g), img_ids=img_ids, txt_ids=txt_ids)


def _flux_loss_grads(model, inputs, weight, mesh=None):
    """Output, and gradients of sum(output * weight) w.r.t. the parameters and the two hidden-state inputs."""
    x = {k: v.clone().requires_grad_(k in ("hidden_states", "encoder_hidden_states")) for k, v in inputs.items()}
    out = model(**x).sample
    (out * weight).sum().backward()
    grads = {"hidden_states": x["hidden_states"].grad, "encoder_hidden_states": x["encoder_hidden_states"].grad}
    if mesh is not None:    # each rank holds the input gradient of its own tokens: sum them
        for g in grads.values():
            dist.all_reduce(g, group=mesh.sp_group)
    params = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, params


def flux_case(U=2, R=1, text_len=16, control=None, checkpointing=False, seed=0):
    """Tiny Flux (2 double + 2 single blocks) under parallelize(), vs single-process, output and
    gradients.  ``control`` runs a deliberately broken variant whose error must be large:
    "img_ids" gives each rank the image RoPE ids of other tokens, "local" skips usp-hal
    attention (each rank attends to its own tokens only)."""
    from usp_hal.integrations import diffusers as usp

    mesh = get_mesh(U, R)
    ref = tiny_flux(seed)
    model = copy.deepcopy(ref)
    inputs = flux_inputs(text_len, seed=seed)
    weight = torch.randn(2, inputs["hidden_states"].shape[1], 8, generator=torch.Generator().manual_seed(seed + 3))
    if checkpointing:
        model.enable_gradient_checkpointing()
    if control is None:
        handle = usp.parallelize(model, mesh, attn_type="sdpa")
        try:
            out, grads, params = _flux_loss_grads(model, inputs, weight, mesh)
            usp.sync_gradients(model, mesh)
            params = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        finally:
            handle.remove()
    else:
        out = _flux_control(model, inputs, mesh, control, usp)
        grads = params = None
    if mesh.sp_rank != 0:
        return {}
    rout, rgrads, rparams = _flux_loss_grads(ref, inputs, weight)
    res = {"out_diff": _max_diff(out, rout), "out_scale": float(rout.abs().max())}
    if grads is not None:
        res["input_grad_diff"] = max(_max_diff(grads[k], rgrads[k]) for k in grads)
        res["param_grad_diff"] = max(_max_diff(params[n], rparams[n]) for n in rparams)
        res["param_grad_scale"] = max(float(g.abs().max()) for g in rparams.values())
        res["params_compared"] = len(rparams)
    return res


def _flux_control(model, inputs, mesh, control, usp):
    sh = {k: v for k, v in inputs.items()}
    for k, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
        sh[k] = usp_hal.shard(inputs[k], mesh=mesh, seq_dim=dim)
    if control == "img_ids":            # the right number of ids, but another rank's tokens' ids
        sh["img_ids"] = usp_hal.shard(inputs["img_ids"].flip(0), mesh=mesh, seq_dim=0)
    handle = usp.enable_attention(model, mesh, attn_type="sdpa") if control != "local" else None
    try:
        with torch.no_grad():
            local = model(**sh).sample
    finally:
        if handle is not None:
            handle.remove()
    return usp_hal.unshard(local, mesh=mesh)


def flux_refusals(U=1, R=2, text_len=7, seed=0):
    """What parallelize() must refuse on every rank, and that remove() restores the model."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from usp_hal.integrations import diffusers as usp

    mesh = get_mesh(U, R)
    before = _AttentionBackendRegistry._active_backend
    ref = tiny_flux(seed)
    model = copy.deepcopy(ref)
    inputs = flux_inputs(text_len, seed=seed)
    with torch.no_grad():
        want = ref(**inputs).sample
    res = {}
    handle = usp.parallelize(model, mesh, attn_type="sdpa")
    with torch.no_grad():
        mask = torch.ones(2, text_len + inputs["hidden_states"].shape[1], dtype=torch.bool)
        mask[0, 0] = False      # a padded text token in the joint sequence
        res["attention_mask"] = error_of(lambda: model(**inputs, joint_attention_kwargs={"attention_mask": mask}))
        block = model.single_transformer_blocks[0].attn
        original = block.processor

        def bypass(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
            return hidden_states          # attention that never calls dispatch_attention_fn
        block.processor = bypass
        res["bypassing_processor"] = error_of(lambda: model(**inputs))
        block.processor = original
        res["twice"] = error_of(lambda: usp.parallelize(model, mesh))
        res["ids_3d"] = error_of(lambda: model(**{**inputs, "txt_ids": inputs["txt_ids"][None]}))
        res["after_refusals_diff"] = _max_diff(model(**inputs).sample, want)
    handle.remove()
    with torch.no_grad():
        res["after_remove_diff"] = _max_diff(model(**inputs).sample, want)
    res["active_backend_restored"] = _AttentionBackendRegistry._active_backend == before
    return res


# ----------------------------------------------------------------------------- examples (no ranks)
def _code_lines(path: Path):
    """The script's lines without its module docstring."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines()
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and \
        isinstance(getattr(tree.body[0], "value", None), ast.Constant) else None
    if doc is not None:
        lines = lines[:doc.lineno - 1] + lines[doc.end_lineno:]
    return [ln for ln in lines if ln.strip()]


def added_lines(single: str, sp: str):
    a, b = _code_lines(EXAMPLES / single), _code_lines(EXAMPLES / sp)
    return [ln[1:] for ln in difflib.unified_diff(a, b, lineterm="", n=0)
            if ln.startswith("+") and not ln.startswith("+++")]


def llama_packed(U=2, R=1, layout="zigzag", docs=(17, 5, 28), source="cu_seqlens", seed=0):
    """A packed row of documents through shard_batch and the usp_hal attention function
    against single-process: each document run alone (its own positions, no cross-document
    attention), logits, the loss over every document (num_items_in_batch: all of them) and
    its parameter gradients.  ``source``: where shard_batch finds the boundaries: the
    ``cu_seqlens`` argument, the collator's ``cu_seq_lens_q/k``, or restarting position_ids."""
    from usp_hal.integrations import transformers as usp
    from usp_hal.sequence.positions import cu_seqlens_from_lengths, document_positions

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_u{U}r{R}_{layout}", mesh=mesh, layout=layout, attn_type="sdpa", enable=True)
    ref = tiny_llama(seed)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    cu = cu_seqlens_from_lengths(docs)
    S = cu[-1]
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(seed + 7))
    batch = {"input_ids": ids, "labels": ids}
    kw = {}
    if source == "cu_seqlens":
        kw["cu_seqlens"] = cu
    elif source == "collator":
        t = torch.tensor(cu, dtype=torch.int32)
        batch.update(cu_seq_lens_q=t, cu_seq_lens_k=t, max_length_q=max(docs), max_length_k=max(docs),
                     position_ids=document_positions(torch.arange(S), cu).unsqueeze(0))
    else:
        batch["position_ids"] = document_positions(torch.arange(S), cu).unsqueeze(0)
    sharded = usp.shard_batch(batch, mesh, layout, **kw)
    out = model(**sharded)
    out.loss.backward()
    loss = float(usp.sync_gradients(model, mesh, out.loss))
    logits = usp_hal.unshard(out.logits.detach(), layout=layout, mesh=mesh, cu_seqlens=cu)
    res = {"loss": loss, "num_items": sharded["num_items_in_batch"]}
    if mesh.sp_rank != 0:
        return res
    total = sum(n - 1 for n in docs if n > 0)
    ref_loss = 0.0
    ref_logits = []
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        piece = ids[:, a:b]
        o = ref(input_ids=piece, labels=piece, num_items_in_batch=total)
        o.loss.backward()
        ref_loss += float(o.loss)
        ref_logits.append(o.logits.detach())
    res.update(total=total, loss_diff=abs(loss - ref_loss), logits_diff=_max_diff(logits, torch.cat(ref_logits, 1)),
               grad_diff=max(_max_diff(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
               grad_scale=max(float(q.grad.abs().max()) for q in ref.parameters()))
    return res


def tiny_deepseek_v3(seed: int = 0):
    """A tiny DeepSeek-V3 (multi-head latent attention: query/key head dim 24, value head dim 16)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                           topk_group=1, vocab_size=VOCAB, max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


def model_matches_one_process(family="deepseek_v3", U=2, R=1, layout="zigzag", B=2, S=24, seed=0,
                              attn_type="sdpa", steps=0, lr=1e-3):
    """A tiny model of ``family`` (``deepseek_v3``: MLA, Dk != Dv; ``gemma2``: attention softcap)
    through ``attn_implementation="usp_hal"`` against the same model in one process: logits,
    loss and every parameter's gradient, then ``steps`` AdamW steps (their losses).  Rank 0
    returns the differences and the size of the reference's gradients."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_test_{family}_u{U}r{R}_{layout}_{attn_type}", mesh=mesh, layout=layout,
                        attn_type=attn_type, enable=True)
    ref = tiny_deepseek_v3(seed) if family == "deepseek_v3" else tiny_gemma2(seed)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    ids = _batches(1, B, S, seed)[0]
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    res: dict = {"losses": [], "ref_losses": []}
    for i in range(steps + 1):
        out = model(**batch)
        out.loss.backward()
        loss = usp.sync_gradients(model, mesh, out.loss)
        logits = usp_hal.unshard(out.logits.detach(), layout=layout, mesh=mesh)
        rout = ref(input_ids=ids, labels=ids)
        rout.loss.backward()
        if i == 0:
            res.update(logits_diff=_max_diff(logits, rout.logits), loss_diff=abs(loss.item() - rout.loss.item()),
                       grad_diff=max(_max_diff(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
                       grad_scale=max(float(q.grad.abs().max()) for q in ref.parameters()))
        res["losses"].append(loss.item())
        res["ref_losses"].append(rout.loss.item())
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    return res if mesh.sp_rank == 0 else {}


def tiny_gemma2(seed: int = 0):
    """A tiny Gemma2 with its attention logit softcap (and the final logit softcap)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
                       attn_logit_softcapping=5.0, final_logit_softcapping=30.0, sliding_window=8,
                       attention_dropout=0.0)
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg)
    model.set_attn_implementation("eager")
    return model
