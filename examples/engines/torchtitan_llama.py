"""torchtitan's Llama3 with usp-hal as its context parallel: packed documents, FSDP2.

    torchrun --nproc_per_node 4 examples/engines/torchtitan_llama.py          # dp_shard 2 x cp 2 (Ring 2)
    python examples/spawn.py --nproc 2 examples/engines/torchtitan_llama.py   # cp 2

torchtitan's own model definition and initialiser (a tiny Llama3 from a config, its attention
torchtitan's ScaledDotProductAttention module), its ``ParallelDims`` meshes and FSDP2
(``apply_fsdp_to_decoder``), 3 AdamW steps on batches of packed documents as torchtitan's
dataloader makes them (positions restart at 0 at every document), the loss over the global
token count as torchtitan's trainer computes it.  This is ``parallelize_llama`` with
``apply_usp`` where ``apply_cp_to_forward`` was, and the trainer's ``post_dataloading_process``
with ``prepare_inputs`` where ``get_attention_masks`` and ``prepare_context_parallel_input`` were.
torchtitan's trainer itself needs CUDA, so on the CPU the script drives those pieces itself;
three CPU-only steps are marked as such.

What usp-hal adds is between ``# usp-hal: begin`` and ``# usp-hal: end`` (tests/test_engine_recipes.py
counts those lines for docs/engines.md and runs this file against the same model in one process,
every document alone)."""
import argparse

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as parallel_dims_module
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, _output_linear_init
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

# usp-hal: begin
import usp_hal
from usp_hal.integrations.torchtitan import apply_usp, prepare_inputs

# usp-hal: end

STEPS, BATCH, SEQ, VOCAB, DIM, HEADS, LR, MAX_NORM, SEED = 3, 2, 24, 128, 64, 4, 2e-3, 1.0, 0


def build_model() -> Llama3Model:
    layers = _build_llama3_layers(n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=2, hidden_dim=128,
                                  rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=256, theta=10000.0,
                                                          scaling="none"), attn_backend="flex")
    for layer in layers:             # torchtitan's SDPA module (its flex one needs Inductor's compile)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(dim=DIM, vocab_size=VOCAB, layers=layers,
                                tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                                                param_init=_EMBEDDING_INIT),
                                norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
                                lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                                      param_init=_output_linear_init(DIM)))
    set_llama3_sharding_config(config, enable_sp=False)
    torch.manual_seed(SEED)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def batches(replicas: int) -> list:
    """Per replica: (tokens, labels, positions) ``[BATCH, SEQ]``, documents packed as torchtitan's
    text dataloader packs them: positions restart at 0 at every document, labels are the next
    token inside the document (-100 after its last one)."""
    g = torch.Generator().manual_seed(SEED + 1)
    out = []
    for _ in range(replicas):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        positions, labels = torch.empty(BATCH, SEQ, dtype=torch.long), torch.full((BATCH, SEQ), -100)
        for b in range(BATCH):
            cuts = sorted(set(torch.randperm(SEQ - 2, generator=g)[:3].add(1).tolist()) | {0, SEQ})
            for start, end in zip(cuts[:-1], cuts[1:]):
                positions[b, start:end] = torch.arange(end - start)
                labels[b, start:end - 1] = tokens[b, start + 1:end]
        out.append((tokens, labels, positions))
    return out


def clip(params, max_norm: float) -> float:
    """The total gradient norm (every gradient whole), the gradients then scaled to max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(torch.sqrt(sum(g.full_tensor().double().pow(2).sum() for g in grads)))
    for g in grads:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def main(ulysses: int = 1, ring: int = 2) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  CPU only: the "fake" backend for size-1 dims
    parallel_dims_module.device_type = "cpu"             # CPU only: torchtitan picks "cuda" at import
    cp = ulysses * ring
    dims = parallel_dims_module.ParallelDims(dp_replicate=1, dp_shard=dist.get_world_size() // cp, cp=cp, tp=1, pp=1,
                                             ep=1, world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    dims.build_mesh()
    model = build_model()
    # usp-hal: begin (in place of apply_cp_to_forward)
    mesh = usp_hal.init_sequence_parallel(ulysses, ring, device_mesh=dims.get_mesh("cp"), set_default=False)
    apply_usp(model, mesh, layout="varlen_zigzag")
    # usp-hal: end
    apply_fsdp_to_decoder(model, dims.get_mesh(["fsdp"]), param_dtype=torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False)
    for module in model.modules():                   # CPU only: gloo has no PREMUL_SUM, a SUM is the same here
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    data = batches(dims.dp_shard)
    replica = dims.get_mesh("batch").get_local_rank() if dims.dp_shard > 1 else 0
    tokens, labels, positions = data[replica]
    global_tokens = sum(int((d[1] != -100).sum()) for d in data)
    # usp-hal: begin (in place of get_attention_masks and prepare_context_parallel_input)
    tokens, labels, extra = prepare_inputs(model, tokens, labels, positions=positions)
    # usp-hal: end
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        # usp-hal: begin (in place of `model(tokens, attention_masks=masks, positions=positions)`)
        logits = model(tokens, **extra)
        # usp-hal: end
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 reduction="sum") / global_tokens
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dims.get_mesh("loss").get_group())
        losses.append(float(total))
        grad_norms.append(clip(list(model.parameters()), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {len(losses)}  loss {losses[-1]:.6f}  grad norm {grad_norms[-1]:.6f}")
    params = torch.cat([p.full_tensor().detach().double().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "dp": dims.dp_shard}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    main(**vars(ap.parse_args()))
