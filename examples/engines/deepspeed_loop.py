"""A DeepSpeed ZeRO training loop with usp-hal's sequence parallelism.

    torchrun --nproc_per_node 4 examples/engines/deepspeed_loop.py               # ZeRO-3, dp 2 x sp 2
    python examples/spawn.py --nproc 4 examples/engines/deepspeed_loop.py --stage 2

A tiny Llama from a config, torch AdamW as DeepSpeed's client optimizer, the gradient norm clipped
at 1.0 by DeepSpeed, 3 steps; on a machine without accelerators DeepSpeed runs its CPU accelerator
over gloo.  DeepSpeed is initialised without an mpu, so its data-parallel group is the world and
holds every sequence-parallel group whole: usp-hal's ``engines.backward`` hands the engine the loss
times the sp size, which makes its average over the world the exact gradient.  The same loop runs
a model wrapped in FSDP2 or DDP instead (``engines.backward``/``reduce_gradients`` switch on the
wrapper).

What usp-hal adds to the plain loop is between ``# usp-hal: begin`` and ``# usp-hal: end``
(tests/test_engine_recipes.py counts those lines for docs/engines.md and runs this file against
the same training in one process)."""
import argparse

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

# usp-hal: begin
import usp_hal
from usp_hal.integrations import transformers as usp
from usp_hal.integrations.training import engines

# usp-hal: end

STEPS, BATCH, SEQ, VOCAB, LR, MAX_NORM, SEED = 3, 2, 24, 256, 2e-3, 1.0, 0


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def dataset(rows: int) -> list:
    """``rows`` token rows of SEQ tokens (labels: the tokens; the model shifts them)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (rows, SEQ), generator=g)]


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": MAX_NORM,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}


def main(ulysses: int = 1, ring: int = 2, stage: int = 3) -> dict:
    deepspeed.init_distributed()                       # gloo on DeepSpeed's CPU accelerator
    sp = ulysses * ring
    dp = dist.get_world_size() // sp
    # usp-hal: begin
    mesh = usp_hal.init_sequence_parallel(ulysses_degree=ulysses, ring_degree=ring)
    attention = usp.register("usp_hal", mesh=mesh, layout="zigzag", enable=True)
    # usp-hal: end
    model = build_model()
    # usp-hal: begin
    model.set_attn_implementation(attention)
    # usp-hal: end
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                           config=ds_config(stage))
    data = dataset(STEPS * BATCH * dp)
    # every rank of a sequence-parallel group loads its replica's batches (sp groups are consecutive ranks)
    # usp-hal: begin
    sampler = DistributedSampler(data, num_replicas=dp, rank=dist.get_rank() // sp, shuffle=False)
    # usp-hal: end
    losses, grad_norms = [], []
    for batch in DataLoader(data, batch_size=BATCH, sampler=sampler):
        # usp-hal: begin
        batch = usp.shard_batch(batch, mesh, "zigzag")
        # usp-hal: end
        out = engine(**batch)
        # usp-hal: begin (in place of `engine.backward(out.loss)`)
        engines.backward(engine, out.loss, mesh)
        loss = engines.reduce_gradients(engine, mesh, out.loss)
        # usp-hal: end
        engine.step()
        losses.append(float(loss))
        grad_norms.append(float(engine.get_global_grad_norm()))
        if dist.get_rank() == 0:
            print(f"step {len(losses)}  loss {losses[-1]:.6f}  grad norm {grad_norms[-1]:.6f}")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):     # ZeRO-3: whole again
        params = torch.cat([p.detach().double().reshape(-1).clone() for p in engine.module.parameters()])
    stage = engine.zero_optimization_stage()
    engine.destroy()
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "dp": dp, "zero_stage": stage}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    main(**vars(ap.parse_args()))
