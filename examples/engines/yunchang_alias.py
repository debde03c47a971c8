"""Code written for yunchang, as xDiT (xfuser) writes it, run on usp-hal through the yunchang alias.

    python examples/spawn.py --nproc 2 examples/engines/yunchang_alias.py   # Ulysses 2
    torchrun --nproc_per_node 4 examples/engines/yunchang_alias.py          # Ulysses 2 x Ring 2

yunchang's imports (``yunchang``, ``yunchang.kernels``, ``yunchang.comm.all_to_all``) and its
calls as xfuser 0.7.0 makes them: ``set_seq_parallel_pg`` for the groups, a subclass of
``LongContextAttention`` (xfuser's ``xFuserLongContextAttention`` is one), the latents cut with
``EXTRACT_FUNC_DICT``, the output gathered back.  The model is a DiT-style joint attention block
(text and image tokens in one sequence, no mask, as Flux's) from a small config; one denoising
forward and its backward.  ``install_yunchang_alias()`` makes ``import yunchang`` resolve to
usp-hal (whether or not yunchang is installed); nothing else changes.

What usp-hal adds is between ``# usp-hal: begin`` and ``# usp-hal: end`` (tests/test_engine_recipes.py
counts those lines for docs/engines.md and runs this file against the same block in one process)."""
import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist

# usp-hal: begin
from usp_hal.compat.alias import install_yunchang_alias

install_yunchang_alias()
# usp-hal: end
from yunchang import EXTRACT_FUNC_DICT, LongContextAttention, set_seq_parallel_pg  # noqa: E402
from yunchang.kernels import AttnType  # noqa: E402

SEED = 0


@dataclass
class Config:
    hidden: int = 64
    heads: int = 4
    text_tokens: int = 8
    image_tokens: int = 24
    batch: int = 2


class SequenceParallelAttention(LongContextAttention):
    """As xfuser's ``xFuserLongContextAttention``: yunchang's class with a default of its own."""

    def __init__(self, ring_impl_type: str = "basic", attn_type=None):
        super().__init__(scatter_idx=2, gather_idx=1, ring_impl_type=ring_impl_type,
                         attn_type=attn_type if attn_type is not None else AttnType.TORCH)


class JointAttention(torch.nn.Module):
    """Text and image tokens attend jointly; ``attention(q, k, v)`` takes ``[B, S, H, D]``."""

    def __init__(self, c: Config, attention):
        super().__init__()
        self.c, self.attention = c, attention
        self.qkv = torch.nn.Linear(c.hidden, 3 * c.hidden)
        self.out = torch.nn.Linear(c.hidden, c.hidden)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.c.heads, -1).unbind(2)
        return self.out(self.attention(q, k, v).reshape(B, S, -1))


def build_model(attention) -> JointAttention:
    torch.manual_seed(SEED)
    return JointAttention(Config(), attention)


def latents() -> torch.Tensor:
    """The whole joint sequence ``[B, text + image, hidden]``, the same on every rank."""
    c = Config()
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(c.batch, c.text_tokens + c.image_tokens, c.hidden, generator=g)


def main(ulysses: int = 2, ring: int = 1) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    set_seq_parallel_pg(ulysses, ring, rank, world)
    model = build_model(SequenceParallelAttention())
    x = EXTRACT_FUNC_DICT["basic"](latents(), rank, world_size=world, rd=ring, ud=ulysses).requires_grad_()
    out = model(x)                                         # this rank's tokens
    out.backward(torch.ones_like(out))
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(grads)                                 # the block's weights are shared by every token

    def gather(t):                                         # the whole sequence again, as xfuser gathers it
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts, dim=1)
    return {"output": gather(out), "input_grad": gather(x.grad), "weight_grads": grads}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=2)
    ap.add_argument("--ring", type=int, default=1)
    print(main(**vars(ap.parse_args()))["output"].shape)
