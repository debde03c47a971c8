"""An accelerate training loop with usp-hal's sequence parallelism on a ``ParallelismConfig``.

    accelerate launch --multi_gpu --num_processes 2 examples/engines/accelerate_loop.py   # sp 2 (Ring 2)
    torchrun --nproc_per_node 4 examples/engines/accelerate_loop.py                       # dp 2 x sp 2
    python examples/spawn.py --nproc 4 examples/engines/accelerate_loop.py

(On a machine without GPUs ``--multi_gpu`` is what makes ``accelerate launch`` start the processes
itself, through torch's launcher, and the script's ``Accelerator(cpu=True)`` then runs them over
gloo; ``--cpu`` starts one process unless an MPI hostfile is given.)

A tiny Llama from a config, AdamW, the gradient norm clipped at 1.0, 3 steps; accelerate wraps
the model (DDP over every rank).  The config's ``sp`` dim is usp-hal's group, split into Ulysses x
Ring (``--ulysses``, ``--ring``); the rest of the world is data parallel.  accelerate refuses any
``ParallelismConfig`` on a machine without accelerators, so the Accelerator is built without it
and usp-hal takes the sizes.

What usp-hal adds to the plain loop is between ``# usp-hal: begin`` and ``# usp-hal: end``
(tests/test_engine_recipes.py counts those lines for docs/engines.md and runs this file against
the same training in one process)."""
import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator, ParallelismConfig
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

# usp-hal: begin
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


def main(ulysses: int = 1, ring: int = 2) -> dict:
    accelerator = Accelerator(cpu=True)
    sp = ulysses * ring
    if accelerator.num_processes % sp:
        raise SystemExit(f"{accelerator.num_processes} process(es): launch a multiple of ulysses x ring = {sp}")
    dp = accelerator.num_processes // sp
    pc = ParallelismConfig(dp_replicate_size=dp, sp_size=sp)           # accelerate's sizes
    # usp-hal: begin
    device_mesh, mesh = engines.parallelism_mesh(pc, ulysses_degree=ulysses, ring_degree=ring, device_type="cpu")
    attention = usp.register("usp_hal", mesh=mesh, layout="zigzag", enable=True)
    # usp-hal: end
    model = build_model()
    # usp-hal: begin
    model.set_attn_implementation(attention)
    # usp-hal: end
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
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
        out = model(**batch)
        accelerator.backward(out.loss)
        # usp-hal: begin
        loss = engines.reduce_gradients(model, mesh, out.loss)
        # usp-hal: end
        grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        accelerator.print(f"step {len(losses)}  loss {losses[-1]:.6f}  grad norm {grad_norms[-1]:.6f}")
    params = torch.cat([p.detach().double().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "dp": dp}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--out", help="where rank 0 saves its results (losses, grad norms, parameters; torch.save)")
    args = ap.parse_args()
    results = main(args.ulysses, args.ring)
    if args.out and dist.get_rank() == 0:
        torch.save(results, args.out)
