"""Functions that run on every rank of a WorkerPool for hybrid models (linear attention,
state-space and short-convolution layers) under the transformers integration: tiny models
from their configs, no downloads."""
from __future__ import annotations

import torch

from tests.dist_cases import error_of, get_mesh

VOCAB = 128


def tiny_hybrid(model_type: str, seed: int = 0):
    """A tiny randomly initialised causal LM of ``model_type`` with both kinds of layer."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=256)
    extra = {
        "qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1),
        "lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1], block_ff_dim=96, block_auto_adjust_ff_dim=False),
        "mamba": dict(num_hidden_layers=2, state_size=4, expand=2),
    }[model_type]
    if model_type == "mamba":
        common = dict(vocab_size=VOCAB, hidden_size=32)
    torch.manual_seed(seed)
    cfg = CONFIG_MAPPING[model_type](**common, **extra)
    return AutoModelForCausalLM.from_config(cfg)


def hybrid_refusals(U=1, R=2, B=1, S=16, model_types=("qwen3_next", "lfm2", "mamba")):
    """Each hybrid under attn_implementation="usp_hal" is refused by name on every rank, before
    its first sharded forward; generation too.  A plain attention model still runs."""
    from usp_hal.integrations import transformers as usp

    mesh = get_mesh(U, R)
    name = usp.register(f"usp_hal_hybrid_u{U}r{R}", mesh=mesh, layout="zigzag", attn_type="sdpa")
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag")
    res = {}
    for mt in model_types:
        model = tiny_hybrid(mt)
        model.set_attn_implementation(name)
        gen = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
        res[mt] = error_of(lambda m=model: m(**batch))
        res[mt + "_again"] = error_of(lambda m=model: m(**batch))          # refused every time, not only once
        res[mt + "_generate"] = error_of(lambda m=model, g=gen: m.generate(**g, max_new_tokens=2, do_sample=False))
    return res
