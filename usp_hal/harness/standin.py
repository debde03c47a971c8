"""A Llama-shaped decoder layer and head in plain torch, eager, for calibration: the same kinds of
op as transformers' ``LlamaDecoderLayer`` (RMSNorm in fp32 with its casts, q/k/v/o projections,
RoPE with ``rotate_half``, SDPA, a gated SiLU MLP, residual adds) so that timing it at a few
tokens measures what one more model call costs per layer (``layer_overhead``), and timing the
embedding, final norm, head and loss measures the rest of a call (``model_overhead``).  Only
:mod:`usp_hal.harness.calibrate` uses it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-b, a), dim=-1)


class StandInLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.n1 = nn.Parameter(torch.ones(hidden))
        self.n2 = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: bool = True) -> torch.Tensor:
        """``attention=False``: the layer without its attention kernel (the queries go to the
        output projection as they are), what its token-proportional part costs."""
        b, t, _ = x.shape
        h = _rms(x, self.n1)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) if attention else q
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = _rms(x, self.n2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class StandInHead(nn.Module):
    """Embedding, final norm, LM head and the loss on fp32 logits."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(_rms(x, self.norm)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def rope(t: int, head_dim: int, dtype) -> tuple:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]
