"""A gated DeltaNet language model trained sequence-parallel with fla's kernel under usp-hal's
state passing.

    python examples/spawn.py --nproc 2 examples/engines/fla_gdn.py   # Ring 2, zigzag
    torchrun --nproc_per_node 4 examples/engines/fla_gdn.py          # sp 4

A tiny model from a config: embedding, gated DeltaNet blocks (q/k/v projections, q and k
L2-normalised, ``g = -softplus(...)`` and ``beta = sigmoid(...)`` per value head, with fewer q/k heads
than value heads as in Qwen3-Next), an LM head; 3 AdamW steps.  The recurrence is fla's
``naive_chunk_gated_delta_rule`` (its plain-torch kernel: fla's Triton kernels need a GPU, pass
``kernel="chunk_gated_delta_rule"`` there).  Each rank keeps its tokens and every head; only the
blocks' ``[dk, dv]`` states travel between the ranks.  The blocks have no short convolution (it
would need the previous rank's last tokens).

What usp-hal adds is between ``# usp-hal: begin`` and ``# usp-hal: end`` (tests/test_engine_recipes.py
counts those lines for docs/engines.md and runs this file against the same model in one process,
fla's kernel over the whole sequence)."""
import argparse
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

# usp-hal: begin
import usp_hal
from usp_hal.integrations import fla as usp_fla
from usp_hal.integrations import sync_gradients

# usp-hal: end

STEPS, BATCH, SEQ, LR, MAX_NORM, SEED = 3, 2, 32, 2e-3, 1.0, 0


@dataclass
class Config:
    vocab: int = 128
    hidden: int = 64
    qk_heads: int = 2
    v_heads: int = 4
    head_dim: int = 16
    layers: int = 2


def fla_delta_rule(q, k, v, g, beta):
    """fla's kernel on the whole sequence (the model without usp-hal); its q/k heads repeated over
    the value heads, as fla's GVA kernels index them (its naive kernel takes equal heads)."""
    q, k = (t.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for t in (q, k))
    return naive_chunk_gated_delta_rule(q, k, v, g, beta)[0]


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, c: Config, delta_rule):
        super().__init__()
        self.c, self.delta_rule = c, delta_rule
        self.norm = torch.nn.RMSNorm(c.hidden)
        self.q, self.k = (torch.nn.Linear(c.hidden, c.qk_heads * c.head_dim, bias=False) for _ in range(2))
        self.v = torch.nn.Linear(c.hidden, c.v_heads * c.head_dim, bias=False)
        self.a, self.b = (torch.nn.Linear(c.hidden, c.v_heads) for _ in range(2))
        self.o = torch.nn.Linear(c.v_heads * c.head_dim, c.hidden, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm(x)
        q = F.normalize(self.q(h).view(B, T, self.c.qk_heads, -1), dim=-1)
        k = F.normalize(self.k(h).view(B, T, self.c.qk_heads, -1), dim=-1)
        v = self.v(h).view(B, T, self.c.v_heads, -1)
        g, beta = -F.softplus(self.a(h)), torch.sigmoid(self.b(h))       # log decay < 0, write strength
        return x + self.o(self.delta_rule(q, k, v, g, beta).reshape(B, T, -1))


class Model(torch.nn.Module):
    def __init__(self, c: Config, delta_rule):
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab, c.hidden)
        self.blocks = torch.nn.ModuleList(GatedDeltaNet(c, delta_rule) for _ in range(c.layers))
        self.head = torch.nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(delta_rule=fla_delta_rule) -> Model:
    torch.manual_seed(SEED)
    return Model(Config(), delta_rule)


def batch():
    """(tokens, next-token labels; the last one ignored) ``[BATCH, SEQ]``, the whole sequence."""
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, Config.vocab, (BATCH, SEQ), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)


def main(ulysses: int = 1, ring: int = 2) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ids, labels = batch()
    tokens = int((labels != -100).sum())
    # usp-hal: begin
    mesh = usp_hal.init_sequence_parallel(ulysses_degree=ulysses, ring_degree=ring)
    delta_rule = functools.partial(usp_fla.gated_delta_rule, mesh=mesh, layout="zigzag",
                                   kernel="naive_chunk_gated_delta_rule")
    ids, labels = (usp_hal.shard(t, layout="zigzag", mesh=mesh) for t in (ids, labels))
    # usp-hal: end
    model = build_model(delta_rule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="sum") / tokens
        loss.backward()
        # usp-hal: begin
        loss = sync_gradients(model, mesh, loss)
        # usp-hal: end
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if dist.get_rank() == 0:
            print(f"step {len(losses)}  loss {losses[-1]:.6f}  grad norm {grad_norms[-1]:.6f}")
    params = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "dp": mesh.dp_degree}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=2)
    main(**vars(ap.parse_args()))
