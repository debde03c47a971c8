"""Train a tiny Llama (GQA: 8 query heads, 2 KV heads) for 20 AdamW steps, sequence-parallel.

    torchrun --nproc_per_node 2 examples/llama_sp.py     # or, without torchrun (CPU, gloo):
    python examples/spawn.py examples/llama_sp.py

The same script as llama_single.py plus five lines (marked).  Every rank loads the same global
batch; shard_batch gives each its share of the tokens, their global positions and the labels
shifted over the whole sequence; sync_gradients sums the gradients and the loss over the ranks.
The losses printed equal the single-process ones."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import usp_hal.integrations.transformers as usp  # usp-hal


def main(steps=20, seed=0):
    mesh = usp.init_distributed(ulysses_degree=2, ring_degree=1)  # usp-hal
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=256, attn_implementation=usp.register(enable=True))  # usp-hal  # noqa: E501
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(seed))
    losses = []
    for step in range(steps):
        out = model(**usp.shard_batch({"input_ids": data, "labels": data}, mesh))  # usp-hal
        out.loss.backward()
        loss = usp.sync_gradients(model, mesh, out.loss)  # usp-hal
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"step {step:2d}  loss {loss.item():.6f}")
    return losses


if __name__ == "__main__":
    main()
