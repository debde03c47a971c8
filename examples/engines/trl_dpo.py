"""TRL's DPOTrainer with usp-hal's sequence parallelism (chosen and rejected in one forward, a
reference model).

    python examples/spawn.py --nproc 2 examples/engines/trl_dpo.py   # sp 2 (Ring 2)
    torchrun --nproc_per_node 4 examples/engines/trl_dpo.py          # dp 2 x sp 2

A tiny Llama from a config, a word-level tokenizer and text preference pairs made here (nothing is
downloaded), 3 steps on the CPU.

What usp-hal adds to the plain TRL script is between ``# usp-hal: begin`` and ``# usp-hal: end``
(tests/test_engine_recipes.py counts those lines for docs/engines.md and runs this file against
TRL's plain DPOTrainer in one process).  ``ref_model=`` is counted: plain TRL makes the reference
model itself when it is left out, usp-hal asks for it (it must be sharded like the policy)."""
import argparse
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import DPOConfig, DPOTrainer

# usp-hal: begin
from usp_hal.integrations.trl import usp_config, usp_trainer

DPOTrainer, DPOConfig = usp_trainer(DPOTrainer), usp_config(DPOConfig)
# usp-hal: end

STEPS, BATCH, ROWS, VOCAB, LR, SEED = 3, 2, 24, 256, 3e-3, 0


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def tokenizer() -> PreTrainedTokenizerFast:
    """Words ``t0`` .. ``t255`` (pad ``t0``, eos ``t1``), built here."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def dataset(rows: int) -> Dataset:
    """``rows`` preference pairs: a prompt of 4 to 7 words, a chosen and a rejected answer of 2 to 8."""
    g = torch.Generator().manual_seed(SEED + 950)

    def words(lo: int, hi: int) -> str:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(f"t{int(x)}" for x in torch.randint(3, VOCAB, (n,), generator=g))
    pairs = [(words(4, 7), " " + words(2, 8), " " + words(2, 8)) for _ in range(rows)]
    return Dataset.from_dict({"prompt": [p[0] for p in pairs], "chosen": [p[1] for p in pairs],
                              "rejected": [p[2] for p in pairs]})


def config(out_dir: str, **more) -> dict:
    """The training arguments, the same with and without usp-hal (fp32, no checkpointing: exact)."""
    return dict(output_dir=out_dir, max_steps=STEPS, learning_rate=LR, seed=SEED, logging_steps=1, beta=0.5,
                max_length=None, max_grad_norm=1.0, bf16=False, gradient_checkpointing=False, use_cpu=True,
                save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, **more)


class Logged(TrainerCallback):
    def __init__(self):
        self.losses, self.grad_norms = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.grad_norms.append(float(logs["grad_norm"]))


def main(ulysses: int = 1, ring: int = 2) -> dict:
    model, logged = build_model(), Logged()
    with tempfile.TemporaryDirectory() as out_dir:
        args = DPOConfig(**config(out_dir, per_device_train_batch_size=BATCH,
                                  # usp-hal: begin
                                  usp_ulysses_degree=ulysses, usp_ring_degree=ring,
                                  # usp-hal: end
                                  ))
        trainer = DPOTrainer(model=model, args=args, train_dataset=dataset(ROWS), processing_class=tokenizer(),
                             # usp-hal: begin
                             ref_model=build_model(),
                             # usp-hal: end
                             callbacks=[logged])
        trainer.train()
    params = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    return {"losses": logged.losses, "grad_norms": logged.grad_norms, "params": params, "dp": trainer.dp_size}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    print(main(**vars(ap.parse_args()))["losses"])
