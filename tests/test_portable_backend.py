"""The portable backend (``usp_hal.backends.portable``: plain torch, tiled, its own backward)
against float64 attention, feature by feature, forward (out, lse) and gradients, in fp64, fp32
and bf16; given a ring-merged out/lse (the ring's backward contract); its bounded tiles;
``attn_type="auto"`` picking it only when nothing faster serves a call (saying so once) and
listing every candidate's reasons when nothing does; USP calls through it on 2 gloo ranks; and
a tiny Gemma2 (attention softcap) trained through the transformers integration on 2 ranks."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import usp_hal
from tests import dist_cases, integration_cases
from tests.dist_cases import kernel_call, merged_key_blocks
from usp_hal.backends.portable import PortableBackend, tile_shape
from usp_hal.dispatch import registry
from usp_hal.dispatch.capabilities import AttnRequest
from usp_hal.dispatch.reference import reference_attention, tolerance
from usp_hal.harness import compare

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}

# name -> (shape keywords, call keywords); every feature on its own, then all of them together
FEATURES = {
    "plain": ({}, {}),
    "causal": ({}, {"causal": True}),
    "causal_sq_ne_sk": ({"sq": 9, "sk": 21}, {"causal": True}),
    "window": ({}, {"window": (4, 2)}),
    "window_key_offset": ({"sk": 17}, {"window": (3, 5), "key_offset": -6}),
    "alibi_key_offset": ({}, {"alibi": True, "key_offset": 11}),
    "softcap": ({}, {"softcap": 2.0}),
    "mask_empty_rows": ({}, {"mask": True}),
    "gqa": ({"h": 6, "hkv": 2}, {}),
    "mqa_causal": ({"h": 4, "hkv": 1}, {"causal": True}),
    "dk_gt_dv": ({"dk": 24, "dv": 16}, {"causal": True}),
    "dk_lt_dv": ({"dk": 8, "dv": 20}, {}),
    "everything": ({"h": 4, "hkv": 2, "dk": 12, "dv": 8, "sk": 23},
                   {"causal": True, "window": (7, -1), "softcap": 3.0, "alibi": True, "mask": True, "key_offset": 2}),
}


def _case(shape, kw, dtype, seed=0):
    s = dict(b=2, sq=19, sk=None, h=4, hkv=None, dk=16, dv=None)
    s.update(shape)
    b, sq, h = s["b"], s["sq"], s["h"]
    sk, hkv, dk = s["sk"] or sq, s["hkv"] or h, s["dk"]
    dv = s["dv"] or dk
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, dk, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, dk, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, dv, generator=g).to(dtype)
    dout = torch.randn(b, sq, h, dv, generator=g).to(dtype)
    kw = dict(kw)
    kw["alibi_slopes"] = torch.rand(h, generator=g) * 0.5 if kw.pop("alibi", False) else None
    if kw.pop("mask", False):
        keep = torch.rand(b, h, sq, sk, generator=g) > 0.4
        keep[:, :, 1] = False                 # a row that sees no key
        kw["mask"] = keep
    kw["softmax_scale"] = 0.35
    return q, k, v, dout, kw


def _reference(q, k, v, dout, kw):
    qr, kr, vr = (x.to(torch.float64).requires_grad_() for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, **kw)
    return ro.detach(), rl.detach(), torch.autograd.grad(ro, (qr, kr, vr), dout.double())


def _worst(got, ref, dtype, lse=False):
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "rows without keys differ"
    return compare(got[fin], ref[fin], *tolerance(dtype, lse=lse))["worst"]


def _check(kernel, feature, dtype):
    shape, kw = FEATURES[feature]
    q, k, v, dout, kw = _case(shape, kw, dtype)
    ro, rl, rg = _reference(q, k, v, dout, kw)
    out, lse = kernel.forward(q, k, v, kernel_call(**kw))
    assert out.shape == ro.shape and out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lse.is_contiguous()
    grads = kernel.backward(dout, q, k, v, out, lse, kernel_call(**kw))
    errs = {"out": _worst(out, ro, dtype), "lse": _worst(lse, rl, dtype, lse=True)}
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, rg, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
        errs[name] = _worst(g, r, dtype)
    assert max(errs.values()) <= 1.0, errs
    return errs


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_matches_float64(feature, dtype):
    _check(PortableBackend(), feature, DTYPES[dtype])


class _SmallTiles(PortableBackend):
    TILE_ELEMENTS = 2 * 4 * 4 * 16          # many tiles per call: rows of 4, columns of 16


@pytest.mark.parametrize("feature", ["causal", "window_key_offset", "everything", "dk_gt_dv"])
def test_small_tiles_give_the_same_result(feature):
    _check(_SmallTiles(), feature, torch.float64)


@pytest.mark.parametrize("feature", ["causal", "everything"])
def test_ring_blocks_merged_by_lse(feature):
    """Forward per key block merged by lse, then each block's backward given the merged
    out/lse (what the ring does): equal to attention over all keys."""
    shape, kw = FEATURES[feature]
    shape = dict(shape, sk=None, sq=20)
    q, k, v, dout, kw = _case(shape, kw, torch.float64)
    kw.pop("key_offset", None)
    mask = kw.pop("mask", None)
    ro, rl, rg = _reference(q, k, v, dout, dict(kw, mask=mask))
    bounds = [(0, 6), (6, 13), (13, 20)]

    def per_block(a, z):
        extra = {"key_offset": a}
        if mask is not None:
            extra["mask"] = mask[..., a:z]
        return extra
    out, lse, dq, dk, dv, _ = merged_key_blocks(PortableBackend(), q, k, v, dout, bounds, per_block, **kw)
    for got, ref in ((out, ro), (dq, rg[0]), (dk, rg[1]), (dv, rg[2])):
        assert _worst(got, ref, torch.float64) <= 1.0
    assert _worst(lse, rl, torch.float64, lse=True) <= 1.0


class _Largest(TorchDispatchMode):
    """The largest tensor any op makes while active (what a call holds at its widest)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_tiles_bound_memory():
    """No tensor of a call (forward and backward) is larger than a tile or than q/k/v/out;
    with tiles as large as the call, the score matrix itself shows (the check can fail)."""
    B, S, H, D = 1, 256, 2, 8
    q, k, v, dout, kw = _case({"b": B, "sq": S, "h": H, "hkv": 1, "dk": D}, {"causal": True, "softcap": 4.0},
                              torch.float32)

    class Tiled(PortableBackend):
        TILE_ELEMENTS = 1 << 12

    class Whole(PortableBackend):
        TILE_ELEMENTS = 1 << 30
    sizes = {}
    for cls in (Tiled, Whole):
        kernel = cls()
        with _Largest() as seen:
            out, lse = kernel.forward(q, k, v, kernel_call(**kw))
            kernel.backward(dout, q, k, v, out, lse, kernel_call(**kw))
        sizes[cls.__name__] = seen.most
    rows, cols = tile_shape(B, H, S, S, Tiled.TILE_ELEMENTS)
    assert rows * cols * B * H <= Tiled.TILE_ELEMENTS and rows < S
    assert sizes["Tiled"] <= max(Tiled.TILE_ELEMENTS, B * S * H * D), sizes
    assert sizes["Whole"] >= B * H * S * S, sizes


# ----------------------------------------------------------------------------- auto
def test_auto_prefers_a_faster_backend():
    assert registry.REGISTRY.select("auto", AttnRequest(needs_grad=True, causal=True)).NAME == "sdpa"
    assert registry.REGISTRY.select("auto", AttnRequest(head_dim=24, head_dim_v=16, needs_grad=True)).NAME == "sdpa"


def test_auto_falls_back_and_says_so_once(caplog):
    req = AttnRequest(softcap=7.25, needs_grad=True, head_dim=40)
    registry._FELL_BACK.clear()
    with caplog.at_level(logging.WARNING, logger="usp_hal"):
        for _ in range(3):
            assert registry.REGISTRY.select("auto", req) is PortableBackend
    said = [r.getMessage() for r in caplog.records if "'portable'" in r.getMessage()]
    assert len(said) == 1, said
    assert "softcap=7.25 not supported" in said[0] and "sdpa" in said[0]


def test_auto_refusal_lists_every_candidate():
    req = AttnRequest(dropout_p=0.1)
    with pytest.raises(NotImplementedError) as err:
        registry.REGISTRY.select("auto", req)
    text = str(err.value)
    for name in ("sdpa", "portable", "flex"):
        assert f"`{name}" in text, text
    assert text.count("dropout_p=0.1 not supported") >= 3, text


def test_explicit_refusal_names_the_portable_backend():
    with pytest.raises(NotImplementedError, match="backends that would work: portable"):
        registry.REGISTRY.select("sdpa", AttnRequest(softcap=3.0, needs_grad=True))


def test_long_context_attention_with_auto_trains_softcap_on_one_rank():
    q, k, v, dout, kw = _case({"h": 4, "hkv": 2}, {"causal": True, "softcap": 2.5}, torch.float32)
    ro, rl, rg = _reference(q, k, v, dout, kw)
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    attn = usp_hal.LongContextAttention(attn_type="auto")
    out = attn(ql, kl, vl, causal=True, softcap=2.5, softmax_scale=kw["softmax_scale"])
    out.backward(dout)
    assert _worst(out.detach(), ro, torch.float32) <= 1.0
    for g, r in zip((ql.grad, kl.grad, vl.grad), rg):
        assert _worst(g, r, torch.float32) <= 1.0


# ----------------------------------------------------------------------------- multi-rank
@pytest.mark.multirank
@pytest.mark.parametrize("U,R,layout,rotation", [(2, 1, "zigzag", "p2p"), (1, 2, "zigzag", "p2p"),
                                                 (1, 2, "basic", "allgather")], ids=["u2", "r2", "r2-allgather"])
def test_usp_through_portable(pools, U, R, layout, rotation):
    for errs in pools(2).run(dist_cases.usp_case, timeout=120, U=U, R=R, layout=layout, rotation=rotation,
                             causal=True, H=4, Hkv=2, D=12, Dv=8, window=(9, 0), alibi=True, softcap=3.0,
                             attn_type="portable"):
        assert max(errs.values()) <= 1.0, errs


@pytest.mark.multirank
@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_gemma2_softcap_trains_on_the_cpu(pools, U, R):
    r = pools(2).run(integration_cases.model_matches_one_process, timeout=240, family="gemma2", U=U, R=R,
                     layout="zigzag", attn_type="auto", steps=2)[0]
    assert r["logits_diff"] <= 2e-5, r
    assert r["loss_diff"] <= 2e-5, r
    assert r["grad_diff"] <= 2e-5 * max(1.0, r["grad_scale"]), r
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 5e-5, r
    assert r["losses"][-1] < r["losses"][0], r


@pytest.mark.multirank
def test_portable_with_masks_sinks_and_documents_on_a_ring(pools):
    """mask= with sinks, softcap and ALiBi, and packed documents with softcap and a window, on a
    2-rank ring through the portable backend (Dk != Dv): output, lse and gradients vs float64."""
    from tests import dist_masks, dist_varlen
    pool = pools(2)
    for res in pool.run(dist_masks.mask_case, timeout=120, U=1, R=2, layout="zigzag", fam="prefix_lm", dtype="fp64",
                        H=4, Hkv=2, D=12, Dv=8, sinks=True, softcap=2.0, alibi=True, attn_type="portable"):
        assert "dsinks" in res["errs"] and max(res["errs"].values()) <= 1.0, res["errs"]
    for res in pool.run(dist_varlen.packed_case, timeout=120, U=1, R=2, layout="zigzag", causal=True, dtype="fp64",
                        H=4, Hkv=2, D=12, Dv=8, softcap=2.0, window=(3, 0), docs=((5, 7, 4),), attn_type="portable"):
        assert max(res[0].values()) <= 1.0, res[0]
