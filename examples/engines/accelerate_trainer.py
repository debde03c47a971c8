"""The transformers Trainer with usp-hal's sequence parallelism on accelerate's ``ParallelismConfig``.

    torchrun --nproc_per_node 4 examples/engines/accelerate_trainer.py          # dp 2 x sp 2 (Ring 2)
    python examples/spawn.py --nproc 2 examples/engines/accelerate_trainer.py   # sp 2

A tiny Llama from a config and right-padded rows of different lengths (pads labelled -100), 4
steps on the CPU.  ``USPTrainer`` takes the config's ``cp``/``sp`` dim as its sequence-parallel
group (split by ``usp_ulysses_degree``/``usp_ring_degree``) and the ``dp_*`` dims as data
parallel; accelerate never sees the config (it refuses any on a machine without accelerators).

What usp-hal adds to the plain Trainer script is between ``# usp-hal: begin`` and ``# usp-hal: end``
(tests/test_engine_recipes.py counts those lines for docs/engines.md and runs this file against
the plain Trainer in one process)."""
import argparse
import os
import tempfile

import torch
from accelerate import ParallelismConfig
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

# usp-hal: begin (in place of `from transformers import Trainer, TrainingArguments`)
from usp_hal.integrations.training.trainer import USPTrainer as Trainer
from usp_hal.integrations.training.trainer import USPTrainingArguments as TrainingArguments

# usp-hal: end

STEPS, BATCH, ROWS, SEQ, VOCAB, LR, SEED = 4, 2, 32, 24, 256, 3e-3, 0


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def dataset(rows: int) -> list:
    """``rows`` rows of SEQ tokens; row i has ``SEQ - i % 7`` real tokens, then pads (labels -100)."""
    g = torch.Generator().manual_seed(SEED + 500)
    out = []
    for i in range(rows):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        ids[SEQ - i % 7:], labels[SEQ - i % 7:] = 0, -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def config(out_dir: str, **more) -> dict:
    return dict(output_dir=out_dir, max_steps=STEPS, learning_rate=LR, seed=SEED, logging_steps=1, max_grad_norm=1.0,
                use_cpu=True, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, **more)


class Logged(TrainerCallback):
    def __init__(self):
        self.losses, self.grad_norms = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.grad_norms.append(float(logs["grad_norm"]))


def main(ulysses: int = 1, ring: int = 2) -> dict:
    sp = ulysses * ring
    dp = int(os.environ.get("WORLD_SIZE", "1")) // sp
    model, logged = build_model(), Logged()
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(**config(out_dir, per_device_train_batch_size=BATCH,
                                          parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=sp),
                                          # usp-hal: begin
                                          usp_ulysses_degree=ulysses, usp_ring_degree=ring,
                                          # usp-hal: end
                                          ))
        Trainer(model=model, args=args, train_dataset=dataset(ROWS), callbacks=[logged]).train()
    params = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    return {"losses": logged.losses, "grad_norms": logged.grad_norms, "params": params, "dp": dp}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    print(main(**vars(ap.parse_args()))["losses"])
