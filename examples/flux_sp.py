"""One denoising forward and one training step of a tiny Flux transformer, sequence-parallel.

    torchrun --nproc_per_node 2 examples/flux_sp.py      # or, without torchrun (CPU, gloo):
    python examples/spawn.py examples/flux_sp.py

The same script as flux_single.py plus four lines (marked).  Every rank passes the same full
inputs and gets the same full output; parallelize() gives each rank its share of the image
tokens and of the text tokens (7 text tokens on 2 ranks: 4 and 3) with their RoPE ids, and
usp-hal attention joins them.  sync_gradients sums each rank's gradients."""
import torch
from diffusers import FluxTransformer2DModel

import usp_hal.integrations.diffusers as usp  # usp-hal


def main(text_len=7, side=8, seed=0):
    mesh = usp.init_distributed(ulysses_degree=2, ring_degree=1)  # usp-hal
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    usp.parallelize(model, mesh)  # usp-hal
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, side * side, 16, generator=g)                      # image tokens
    text = torch.randn(1, text_len, 32, generator=g)                            # text tokens, any length
    pooled = torch.randn(1, 16, generator=g)
    img_ids = torch.cartesian_prod(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)))
    txt_ids = torch.zeros(text_len, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        out = model(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
                    timestep=torch.tensor([0.5]), img_ids=img_ids, txt_ids=txt_ids).sample
        loss = (out - latents).pow(2).mean()
        loss.backward()
        usp.sync_gradients(model, mesh)  # usp-hal
        opt.step()
        opt.zero_grad()
        print(f"step {step}  loss {loss.item():.6f}  output norm {out.norm().item():.6f}")
    return out.detach()


if __name__ == "__main__":
    main()
