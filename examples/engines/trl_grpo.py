"""TRL's GRPOTrainer with usp-hal's sequence parallelism: the whole script.

    torchrun --nproc_per_node 2 examples/engines/trl_grpo.py         # sp 2 (Ring 2), 1 replica
    python examples/spawn.py --nproc 2 examples/engines/trl_grpo.py  # the same without torchrun

A tiny Llama and a word-level tokenizer built from a config (nothing is downloaded; use your
own), 16 prompts, a reward that counts even token ids, 3 steps: TRL's transformers generation
runs as usp-hal's sequence-parallel generate(), the training step sequence-parallel.

What usp-hal adds to the plain TRL script is between ``# usp-hal: begin`` and ``# usp-hal: end``
(tests/test_engine_recipes.py counts those lines for docs/engines.md;
tests/test_trl.py::test_grpo_recipe_runs_under_torchrun_and_adds_three_lines runs this file under
torchrun on 2 ranks; GRPO's exactness against one process is
tests/test_trl.py::test_grpo_train_matches_single_process)."""
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

# usp-hal: begin
from usp_hal.integrations.trl import usp_config, usp_trainer

GRPOTrainer, GRPOConfig = usp_trainer(GRPOTrainer), usp_config(GRPOConfig)
# usp-hal: end


def share_of_even_tokens(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completion_ids]


def main():
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 256)}},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    prompts = Dataset.from_dict({"prompt": [" ".join(f"w{3 + (7 * i + j) % 250}" for j in range(2 + i % 5))
                                            for i in range(16)]})
    args = GRPOConfig(output_dir="grpo-out", max_steps=3, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, learning_rate=1e-3, bf16=False, logging_steps=1, report_to=[],
                      use_cpu=not torch.cuda.is_available(),
                      # usp-hal: begin
                      usp_ulysses_degree=1, usp_ring_degree=2)
    # usp-hal: end
    trainer = GRPOTrainer(model=model, reward_funcs=share_of_even_tokens, args=args, train_dataset=prompts,
                          processing_class=tokenizer)
    trainer.train()
    print("GRPO steps:", trainer.state.global_step)


if __name__ == "__main__":
    main()
