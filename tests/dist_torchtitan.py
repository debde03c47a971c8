"""Rank functions for torchtitan 0.3.0 under usp-hal (tests/test_engines_torchtitan.py).

Every rank builds the same tiny torchtitan Llama3 (its own model definition and initialiser,
inner attention torchtitan's ``ScaledDotProductAttention``), then parallelises it the way
torchtitan's ``parallelize_llama`` does, with usp-hal where torchtitan's context parallel
would go: ``apply_usp`` on the ``cp`` mesh dim, ``model.parallelize(parallel_dims)`` (TP) and
``apply_fsdp_to_decoder`` over ``fsdp`` (= dp_shard x cp).  4 ranks: dp_shard 2 x sp 2 or
tp 2 x sp 2.  3 AdamW steps with the gradient norm clipped at 1.0; rank 0 trains the same model
unmodified in one process on every replica's batch and compares loss, grad norm and params."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import usp_hal

V, DIM, HEADS, KV_HEADS, LAYERS = 128, 64, 4, 2, 2
_DIMS: dict = {}


def tiny_llama_config(inner: str = "sdpa"):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    layers = _build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=128,
                                  rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=256, theta=10000.0,
                                                          scaling="none"),
                                  attn_backend="flex")
    if inner == "sdpa":       # torchtitan 0.3.0 builds LMs with flex/varlen; its SDPA module runs eagerly on the CPU
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=V, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=V, param_init=_output_linear_init(DIM)))
    set_llama3_sharding_config(cfg, enable_sp=False)
    return cfg


def build(seed: int = 0, inner: str = "sdpa"):
    torch.manual_seed(seed)
    model = tiny_llama_config(inner).build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def batches(replicas: int, B: int, S: int, seed: int):
    """Per replica: (ids, next-token labels, the last one ignored)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(replicas):
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
        out.append((ids, labels))
    return out


def parallel_dims(dp_shard: int, tp: int, cp: int, ring: bool = False):
    """torchtitan's ParallelDims for this world, its meshes on the CPU.  torchtitan 0.3.0 picks
    the mesh device type once, at import (torchtitan/tools/utils.py: ``_get_available_device_type()
    or "cuda"``), and parallel_dims.py imports that name: here it is set to "cpu".  The ``cp``
    dim is usp-hal's mesh: Ulysses over it, or with ``ring`` a ring."""
    key = (dp_shard, tp, cp, ring)
    if key not in _DIMS:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake", for degree-1 dims)
        import torchtitan.distributed.parallel_dims as pd
        pd.device_type = "cpu"
        dims = pd.ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=tp, pp=1, ep=1,
                               world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
        dims.build_mesh()
        mesh = usp_hal.init_sequence_parallel(device_mesh=dims.get_mesh("cp"), set_default=False,
                                              **({"ulysses_degree": 1, "ring_degree": cp} if ring else {}))
        _DIMS[key] = (dims, mesh)
    return _DIMS[key]


def parallelize(model, dims, mesh, layout: str, use_usp: bool = True) -> int:
    """torchtitan's parallelize_llama (partial_dtensor backend) with apply_usp in place of
    apply_cp_to_forward: the recipe a GPU run uses too."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from usp_hal.integrations.torchtitan import apply_usp
    n = apply_usp(model, mesh, layout=layout, attn_type="sdpa") if use_usp else 0
    if dims.tp_enabled:
        model.parallelize(dims)
    apply_fsdp_to_decoder(model, dims.get_mesh(["fsdp"]), param_dtype=torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False)
    # apply_fsdp_to_decoder sets FSDP's divide factor to 1.0 (its trainer divides the loss by the
    # global token count); FSDP then reduce-scatters with PREMUL_SUM(1.0), which gloo refuses
    # ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): a plain SUM is the same reduction
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return n


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _clip(params, max_norm: float = 1.0) -> float:
    """The total gradient norm (every gradient whole), then the gradients scaled to max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.sqrt(sum(_full(g).double().pow(2).sum() for g in grads))
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    for g in grads:
        g.mul_(scale)
    return float(norm)


def one_process(seed: int, data, steps: int, lr: float):
    ref = build(seed)
    ids = torch.cat([d[0] for d in data])
    labels = torch.cat([d[1] for d in data])
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, norms = [], []
    for _ in range(steps):
        logits = ref(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(_clip(list(ref.parameters())))
        opt.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach() for n, p in ref.named_parameters()}


def titan_train(dp_shard: int = 2, tp: int = 1, cp: int = 2, layout: str = "zigzag", steps: int = 3, B: int = 2,
                S: int = 24, seed: int = 0, lr: float = 2e-3, use_usp: bool = True):
    """``steps`` AdamW steps of the tiny Llama on dp_shard x tp x cp (= sp) ranks, torchtitan's
    loss convention (each rank: the sum of its tokens' losses over every replica's token count;
    FSDP sums over dp_shard x cp); rank 0 also returns the comparison with one process.
    ``use_usp=False``: the negative control, torchtitan's attention left on each rank's tokens."""
    from usp_hal.integrations.torchtitan import local_positions
    dims, mesh = parallel_dims(dp_shard, tp, cp)
    replica = dims.get_mesh("batch").get_local_rank() if dp_shard > 1 else 0
    data = batches(dp_shard, B, S, seed + 1)
    model = build(seed)
    layers = parallelize(model, dims, mesh, layout, use_usp)
    calls = []
    if use_usp:
        # the heads each usp-hal call saw: HEADS / tp (TP split them before Ulysses splits them again)
        model._usp_attention.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[2]))
    ids, labels = (usp_hal.shard(t, layout=layout, mesh=mesh) for t in data[replica])
    positions = local_positions(mesh, S, B, layout)
    global_tokens = sum(int((d[1] != -100).sum()) for d in data)
    loss_group = dims.get_mesh("loss").get_group()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for _ in range(steps):
        logits = _full(model(ids, positions=positions))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 reduction="sum") / global_tokens
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=loss_group)      # over batch x cp: torchtitan's "loss" mesh
        losses.append(float(total))
        norms.append(_clip(list(model.parameters())))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p).detach() for n, p in model.named_parameters()}
    res = {"losses": losses, "norms": norms, "usp_calls": len(calls), "heads_seen": sorted(set(calls)),
           "layers": layers,
           "param_kinds": sorted({type(p).__name__ for p in model.parameters()})}
    if dist.get_rank() != 0:
        return res
    ref_losses, ref_norms, ref_params = one_process(seed, data, steps, lr)
    init = dict(build(seed).named_parameters())
    res.update(ref_losses=ref_losses, ref_norms=ref_norms,
               param_diff=max(float((params[n] - p).abs().max()) for n, p in ref_params.items()),
               moved=max(float((p - init[n].detach()).abs().max()) for n, p in ref_params.items()))
    return res


# ----------------------------------------------------------------------------- packed documents
def packed_batches(replicas: int, B: int, S: int, seed: int):
    """Per replica: (ids, labels, positions) ``[B, S]`` as torchtitan's text dataloader packs
    documents (torchtitan/hf_datasets/text_datasets.py): positions restart at 0 at every
    document, labels are the next token inside the document (-100 after its last one).  Each
    row has its own documents, a one-token one among them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(replicas):
        ids = torch.randint(0, V, (B, S), generator=g)
        positions = torch.empty(B, S, dtype=torch.long)
        labels = torch.full((B, S), -100)
        for b in range(B):
            cuts = sorted(set(torch.randperm(S - 2, generator=g)[:3].add(1).tolist()) | {0, S})
            if b == 0:
                cuts = sorted(set(cuts) | {S - 1})                      # a document of one token at the end
            for a, e in zip(cuts[:-1], cuts[1:]):
                positions[b, a:e] = torch.arange(e - a)
                labels[b, a:e - 1] = ids[b, a + 1:e]
        out.append((ids, labels, positions))
    return out


def documents_of(positions_row: torch.Tensor):
    """(start, end) of each document of one row (torchtitan's convention: positions == 0 start one)."""
    starts = (positions_row == 0).nonzero().flatten().tolist() + [positions_row.numel()]
    return list(zip(starts[:-1], starts[1:]))


def one_process_documents(seed: int, data, steps: int, lr: float):
    """The same model unmodified in one process, every document of every row of every replica
    run alone (what a document mask computes), 3 AdamW steps, loss over the global tokens."""
    ref = build(seed)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    tokens = sum(int((lab != -100).sum()) for _, lab, _ in data)
    losses, norms = [], []
    for _ in range(steps):
        loss = 0.0
        for ids, labels, positions in data:
            for b in range(ids.shape[0]):
                for a, e in documents_of(positions[b]):
                    logits = ref(ids[b:b + 1, a:e])
                    loss = loss + torch.nn.functional.cross_entropy(logits[0], labels[b, a:e], ignore_index=-100,
                                                                    reduction="sum")
        loss = loss / tokens
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(_clip(list(ref.parameters())))
        opt.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach() for n, p in ref.named_parameters()}


def titan_document_masks_vs_per_document(seed: int, ids, positions) -> float:
    """torchtitan's own packed-document attention, forward: the model built with its
    FlexAttention and the masks of ``model.get_attention_masks(positions)`` (causal and
    torchtitan's packed-document mask, run eagerly: no Inductor on the CPU), against every
    document run alone through the SDPA model.  Max abs difference of the logits."""
    import torchtitan.models.common.decoder as decoder
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention
    flex = build(seed, inner="flex")
    saved = decoder.create_attention_mask, FlexAttention._compiled_flex_attn
    decoder.create_attention_mask, FlexAttention._compiled_flex_attn = create_block_mask, flex_attention
    try:
        with torch.no_grad():
            got = flex(ids, positions=positions, attention_masks=flex.get_attention_masks(positions))
    finally:
        decoder.create_attention_mask, FlexAttention._compiled_flex_attn = saved
    ref = build(seed)
    with torch.no_grad():
        want = torch.cat([torch.cat([ref(ids[b:b + 1, a:e]) for a, e in documents_of(positions[b])], dim=1)
                          for b in range(ids.shape[0])])
    return float((got - want).abs().max())


def titan_train_packed(dp_shard: int = 1, cp: int = 2, ring: bool = False, layout: str = "varlen_zigzag",
                       steps: int = 3, B: int = 2, S: int = 24, seed: int = 0, lr: float = 2e-3,
                       mutation: Optional[str] = None):
    """``steps`` AdamW steps of the tiny Llama on packed documents, dp_shard x cp (= sp) ranks,
    the batch sharded by ``prepare_inputs`` (torchtitan's per-document positions in); rank 0
    also returns the comparison with one process (every document alone).  ``mutation=
    "ignore_documents"``: the attention is not told the boundaries (the negative control)."""
    from usp_hal.integrations.torchtitan import prepare_inputs
    dims, mesh = parallel_dims(dp_shard, 1, cp, ring)
    replica = dims.get_mesh("batch").get_local_rank() if dp_shard > 1 else 0
    data = packed_batches(dp_shard, B, S, seed + 1)
    model = build(seed)
    layers = parallelize(model, dims, mesh, layout)
    attn = model._usp_attention
    calls = []
    attn.register_forward_hook(lambda mod, args, kwargs, out: calls.append(kwargs.get("cu_seqlens")),
                               with_kwargs=True)
    if mutation == "ignore_documents":
        inner = attn.forward
        attn.forward = lambda *a, cu_seqlens=None, **k: inner(*a, **k)
    ids, labels, extra = prepare_inputs(model, *(data[replica][i] for i in (0, 1, 2)))
    global_tokens = sum(int((d[1] != -100).sum()) for d in data)
    loss_group = dims.get_mesh("loss").get_group()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for _ in range(steps):
        logits = _full(model(ids, **extra))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 reduction="sum") / global_tokens
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=loss_group)
        losses.append(float(total))
        norms.append(_clip(list(model.parameters())))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p).detach() for n, p in model.named_parameters()}
    batch = extra["attention_masks"]
    res = {"losses": losses, "norms": norms, "layers": layers, "usp_calls": len(calls),
           "documents": len(batch.cu_seqlens) - 1, "cu_passed": all(c == list(batch.cu_seqlens) for c in calls),
           "local_shape": tuple(ids.shape)}
    if dist.get_rank() != 0:
        return res
    ref_losses, ref_norms, ref_params = one_process_documents(seed, data, steps, lr)
    init = dict(build(seed).named_parameters())
    res.update(ref_losses=ref_losses, ref_norms=ref_norms,
               param_diff=max(float((params[n] - p).abs().max()) for n, p in ref_params.items()),
               moved=max(float((p - init[n].detach()).abs().max()) for n, p in ref_params.items()),
               titan_masks=titan_document_masks_vs_per_document(seed, data[0][0], data[0][2]))
    return res


# ----------------------------------------------------------------------------- refusals
def titan_refusal(case: str, S: int = 24, B: int = 2, seed: int = 0) -> dict:
    """A model call apply_usp must refuse, on 2 ranks (ring 2, FSDP over them): {"error":
    type name, "message": text, "seconds": from the call to the error}, or {"ran": True}
    when the call went through (the silent case)."""
    import time

    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from usp_hal.integrations import torchtitan as tt
    from usp_hal.integrations.torchtitan import local_positions
    dims, mesh = parallel_dims(1, 1, 2, True)
    model = build(seed)
    parallelize(model, dims, mesh, "varlen_zigzag" if case == "documents_other_layout" else "zigzag")
    ids, labels, positions = packed_batches(1, B, S, seed + 1)[0]
    rank = dist.get_rank()
    kwargs: dict = {}
    if case == "basic_layout":               # usp_hal.shard's default layout, and that layout's positions
        tokens = usp_hal.shard(ids, mesh=mesh)
        kwargs["positions"] = local_positions(mesh, S, B, "basic")
    elif case == "one_rank_without_positions":
        tokens = usp_hal.shard(ids, layout="zigzag", mesh=mesh)
        kwargs["positions"] = local_positions(mesh, S, B, "zigzag") if rank == 0 else None
    elif case in ("titan_varlen_metadata", "titan_block_mask"):
        tokens = usp_hal.shard(ids, layout="zigzag", mesh=mesh)
        kwargs["positions"] = local_positions(mesh, S, B, "zigzag")
        if case == "titan_varlen_metadata":
            kwargs["attention_masks"] = create_varlen_metadata_for_document(positions)
        else:
            from torch.nn.attention.flex_attention import and_masks, create_block_mask
            from torchtitan.models.common.attention import (
                get_causal_mask_mod,
                get_efficient_causal_mask_mod_for_packed_document,
            )
            kwargs["attention_masks"] = create_block_mask(
                and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions)),
                B, None, S, S, device="cpu")
    elif case == "different_batches":
        tokens, _, kwargs = tt.prepare_inputs(model, ids + rank, labels, positions)
    elif case == "not_per_document_positions":
        bad = positions.clone()
        bad[1, 5] += 7
        tokens, _, kwargs = tt.prepare_inputs(model, ids, labels, bad)
    elif case == "documents_other_layout":   # the model's layout is varlen_zigzag: tokens and positions by hand
        _, _, kwargs = tt.prepare_inputs(model, ids, labels, positions)
        cu = kwargs["attention_masks"].cu_seqlens
        tokens = usp_hal.shard(ids.reshape(1, -1), layout="zigzag", mesh=mesh, cu_seqlens=cu)
        kwargs["positions"] = usp_hal.shard(positions.reshape(1, -1), layout="zigzag", mesh=mesh, cu_seqlens=cu)
    else:
        raise ValueError(case)
    dist.barrier()
    t0 = time.monotonic()
    try:
        model(tokens, **kwargs)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    return {"ran": True}


# ----------------------------------------------------------------------------- gpt-oss attention (sinks)
class _Layers(torch.nn.Module):
    """Blocks of torchtitan's gpt-oss ``Attention`` (sinks; layer 0 with a causal sliding window),
    shaped as torchtitan's Decoder is where apply_usp looks (``.layers[i].attention`` and
    ``.config.layers[i].attention``).  The MoE of gpt-oss's block is left out: its experts run
    in bfloat16 (torchtitan/models/gpt_oss/moe.py), which an exact comparison cannot use."""

    def __init__(self, cfgs):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(layers=[SimpleNamespace(attention=c) for c in cfgs])
        self.layers = torch.nn.ModuleDict()
        for i, c in enumerate(cfgs):
            block = torch.nn.Module()
            block.attention = c.build()
            self.layers[str(i)] = block

    def forward(self, x, positions=None, masks=None):
        for i, block in self.layers.items():
            x = x + block.attention(x, masks[i] if masks else None, positions)
        return x


def gptoss_layers(seed: int = 0, window: int = 8):
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.gpt_oss import _make_gptoss_attn_config
    rope = CosSinRoPE.Config(dim=16, max_seq_len=256, theta=150000.0)
    cfgs = [_make_gptoss_attn_config(dim=DIM, layer_id=i, attn_backend="flex", n_heads=HEADS, n_kv_heads=KV_HEADS,
                                     head_dim=16, sliding_window_size=window if i == 0 else None, rope=rope)
            for i in range(2)]
    torch.manual_seed(seed)
    model = _Layers(cfgs)
    for block in model.layers.values():
        block.attention.init_states(buffer_device=torch.device("cpu"))
        with torch.no_grad():
            block.attention.sinks.normal_(0.0, 1.0)       # sinks that matter
    return model.double()


def _math_inner(window: Optional[int]):
    """Attention as torchtitan's FlexAttention computes it for gpt-oss (causal, optional
    sliding window, lse handed to ``out_transform``), in plain float64 torch: flex_attention has
    no backward on the CPU ("FlexAttention does not support backward on CPU")."""
    def forward(q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, out_transform=None, **_):
        H, Hkv = q.shape[2], k.shape[2]
        k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
        scores = torch.einsum("blhd,bshd->bhls", q, k) * scale
        L = q.shape[1]
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        keep = (j <= i) & ((i - j < window) if window else True)
        scores = scores.masked_fill(~keep, float("-inf"))
        lse = scores.logsumexp(-1)                                   # [B, H, L]
        out = torch.einsum("bhls,bshd->blhd", (scores - lse[..., None]).exp(), v)
        return out_transform(out, lse.transpose(1, 2))
    return forward


def gptoss_reference(seed: int, x, dout, window: int):
    """torchtitan's gpt-oss attention modules in one process (their projections, RoPE, GQA and
    sink rescaling), the inner attention in float64 math; its forward also checked against
    torchtitan's own FlexAttention (eager flex_attention, forward only on the CPU)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention, get_causal_mask_mod, get_sliding_window_mask_mod
    B, S = x.shape[:2]
    pos = torch.arange(S).expand(B, S)
    flex = gptoss_layers(seed, window)
    causal = get_causal_mask_mod()
    masks = {"0": create_block_mask(and_masks(causal, get_sliding_window_mask_mod(window)), B, None, S, S,
                                    device="cpu"),
             "1": create_block_mask(causal, B, None, S, S, device="cpu")}
    saved = FlexAttention._compiled_flex_attn
    FlexAttention._compiled_flex_attn = flex_attention        # eager: no Inductor compile on the CPU
    try:
        with torch.no_grad():
            flex_out = flex(x, positions=pos, masks=masks)
    finally:
        FlexAttention._compiled_flex_attn = saved
    model = gptoss_layers(seed, window)
    for i, block in model.layers.items():
        block.attention.inner_attention.forward = _math_inner(window if i == "0" else None)
    xin = x.clone().requires_grad_()
    out = model(xin, positions=pos)
    out.backward(dout)
    return out.detach(), xin.grad, {n: p.grad for n, p in model.named_parameters()}, \
        float((out.detach() - flex_out).abs().max())


def gptoss_case(U: int = 2, R: int = 2, layout: str = "zigzag", B: int = 2, S: int = 40, window: int = 8,
                seed: int = 0) -> dict:
    """gpt-oss attention (sinks, sliding window, GQA) through apply_usp on U x R ranks, float64:
    {name: max abs error} of the output and of the input's and every parameter's gradient
    (summed over the group by sync_gradients) against one process, on rank 0."""
    from tests.dist_cases import get_mesh
    from usp_hal.integrations import sync_gradients
    from usp_hal.integrations.torchtitan import apply_usp, local_positions
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(B, S, DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(B, S, DIM, generator=g, dtype=torch.float64)
    model = gptoss_layers(seed, window)
    n = apply_usp(model, mesh, layout=layout)
    xin = usp_hal.shard(x, layout=layout, mesh=mesh).requires_grad_()
    out = model(xin, positions=local_positions(mesh, S, B, layout))
    out.backward(usp_hal.shard(dout, layout=layout, mesh=mesh))
    sync_gradients(model, mesh)
    res = {"layers": n}
    if dist.get_rank() != 0:
        return res
    ref_out, ref_dx, ref_grads, res["math_vs_flex"] = gptoss_reference(seed, x, dout, window)

    def sh(t):
        return usp_hal.shard(t, layout=layout, mesh=mesh)
    res["out"] = float((out.detach() - sh(ref_out)).abs().max())
    res["dx"] = float((xin.grad - sh(ref_dx)).abs().max())
    res["dparams"] = max(float((p.grad - ref_grads[name]).abs().max()) for name, p in model.named_parameters())
    res["dsinks"] = max(float((p.grad - ref_grads[name]).abs().max()) for name, p in model.named_parameters()
                        if name.endswith("sinks"))
    res["sinks_grad_size"] = max(float(ref_grads[name].abs().max()) for name in ref_grads if name.endswith("sinks"))
    return res
