"""Train a tiny Llama (GQA: 8 query heads, 2 KV heads) for 20 AdamW steps on one process.
The baseline of llama_sp.py: run both and compare the losses."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(steps=20, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=256)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(seed))
    losses = []
    for step in range(steps):
        out = model(input_ids=data, labels=data)
        out.loss.backward()
        loss = out.loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"step {step:2d}  loss {loss.item():.6f}")
    return losses


if __name__ == "__main__":
    main()
