"""Rank-side functions for tests/test_seams.py: a layout and a wire codec added from outside
the package, exactly as docs/architecture.md shows, run through LongContextAttention."""
from __future__ import annotations

import torch

import usp_hal
from tests.dist_cases import _err, get_mesh
from usp_hal.dispatch.reference import reference_attention
from usp_hal.parallel.codec import CODECS, Codec, register_codec
from usp_hal.sequence.positions import LAYOUTS, Layout, Segment, register_layout


def _halves(seqlen, ring_size, ring_rank):
    half = seqlen // 2
    sizes = [half // ring_size + (i < half % ring_size) for i in range(ring_size)]
    rest = seqlen - half
    sizes2 = [rest // ring_size + (i < rest % ring_size) for i in range(ring_size)]
    a, b = sum(sizes[:ring_rank]), half + sum(sizes2[:ring_rank])
    return [Segment(a, sizes[ring_rank]), Segment(b, sizes2[ring_rank])]


class BFloat16Codec(Codec):
    name, identity, lossy = "bf16", False, True

    def encode(self, x):
        return [x.to(torch.bfloat16)]

    def decode(self, parts, dtype):
        return parts[0].to(dtype)

    def roundtrip(self, x):
        return x.to(torch.bfloat16).to(x.dtype)

    def wire_bytes(self, shape, dtype):
        return 2 * torch.Size(shape).numel()


def _register():
    if "halves" not in LAYOUTS:
        register_layout(Layout("halves", _halves, contiguous=True, description="two contiguous chunks per rank"))
    if "bf16" not in CODECS:
        register_codec(BFloat16Codec)


def layout_case(U=1, R=2, S=13, H=4, Hkv=2, D=8, causal=True, window=(-1, -1), rotation="p2p"):
    """The registered layout through the whole path: forward and gradients vs float64."""
    _register()
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    dout = torch.randn(1, S, H, D, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves, causal=causal, window=window)
    ref.backward(dout)
    sh = lambda x: usp_hal.shard(x, layout="halves", mesh=mesh)  # noqa: E731
    loc = [sh(x).requires_grad_() for x in (q, k, v)]
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="halves", rotation=rotation, mesh=mesh)
    out = attn(*loc, causal=causal, window_size=window)
    out.backward(sh(dout))
    full = usp_hal.unshard(out.detach(), layout="halves", mesh=mesh)
    errs = {"out": _err(out, sh(ref), torch.float64), "unshard": _err(full, ref, torch.float64)}
    for name, a, b in zip(("dq", "dk", "dv"), loc, leaves):
        errs[name] = _err(a.grad, sh(b.grad), torch.float64)
    return errs


def codec_case(U=2, R=1, S=12, H=4, D=8, causal=False):
    """The registered bf16 codec on q, v and out with fp32 inputs equals single-device
    attention on bf16-rounded q and v followed by a bf16 rounding of the output (fp32
    tolerance): the codec is applied where the docs say and nowhere else."""
    _register()
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    rt = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
    ref, _ = reference_attention(rt(q).double(), k.double(), rt(v).double(), causal=causal)
    ref = rt(ref.float())
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh,
                                        wire_codecs={"q": "bf16", "v": "bf16", "out": "bf16"})
    sh = lambda x: usp_hal.shard(x, layout="zigzag", mesh=mesh)  # noqa: E731
    with torch.no_grad():
        out = attn(sh(q), sh(k), sh(v), causal=causal)
    exact = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)
    with torch.no_grad():
        plain = exact(sh(q), sh(k), sh(v), causal=causal)
    # the lossy path differs from the exact one (the codec really ran) but matches its emulation
    return {"emulated": _err(out, sh(ref), torch.float32), "differs": float((out - plain).abs().max())}
