"""The FlexAttention backend (``usp_hal.backends.flex``) against the float64 reference.

On the CPU this runs torch 2.13's real ``flex_attention`` (uncompiled: the only CPU path
with an lse): out and lse of direct adapter calls (with and without ``mask=``, rows the
mask empties, GQA, windows and alibi across a key offset, softcap, ``Sq != Sk``, lengths
that are not multiples of flex's 128-wide blocks) and a forward through
``LongContextAttention`` on one rank.  The CPU has no flex backward, so a training call is
refused with the declared reason.

The CUDA path (compiled flex, backward) cannot run here: its backward is checked under
``platform.emulate("cuda")`` with ``flex_ops`` replaced by torch's own unfused flex with the
CPU refusal lifted.  That proves the adapter's backward (the re-weighting to a given
out/lse), not flex's Triton kernels.
"""
from __future__ import annotations

import pytest
import torch

import usp_hal
from tests.dist_cases import kernel_call, kernel_inputs, merged_key_blocks
from usp_hal import KernelCall
from usp_hal.backends import flex as flex_module
from usp_hal.backends.flex import FlexAttentionBackend
from usp_hal.dispatch import platform
from usp_hal.dispatch.backend import Unsupported
from usp_hal.dispatch.capabilities import AttnRequest
from usp_hal.dispatch.reference import LSE_TOLERANCES, TOLERANCES, reference_attention

KERNEL = FlexAttentionBackend()
IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _inputs(dtype, b=2, sq=13, sk=None, h=4, hkv=None, d=16, seed=0, dv=None):
    q, k, v, dout = kernel_inputs(b, sq, sq if sk is None else sk, h, h if hkv is None else hkv, d, dtype, seed)
    if dv is not None:      # a value head dim of its own (MLA)
        g = torch.Generator().manual_seed(seed + 1)
        v = torch.randn(*v.shape[:3], dv, generator=g).to(dtype)
        dout = torch.randn(*dout.shape[:3], dv, generator=g).to(dtype)
    return q, k, v, dout


def _close(got, ref, dtype, what, lse=False):
    atol, rtol = (LSE_TOLERANCES if lse else TOLERANCES)[dtype]
    got = got.to(torch.float64)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{what}: -inf rows differ"
    fin = torch.isfinite(ref)
    assert not torch.isnan(got).any(), f"{what}: NaN"
    diff = (got[fin] - ref[fin]).abs()
    bound = atol + rtol * ref[fin].abs()
    assert bool((diff <= bound).all()), f"{what}: max error {diff.max():.3e} over ({atol}, {rtol})"


def _forward_check(dtype, shape=None, **kw):
    q, k, v, _ = _inputs(dtype, **(shape or {}))
    kw.setdefault("softmax_scale", 0.3)
    out, lse = KERNEL.forward(q, k, v, kernel_call(**kw))
    assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_out, ref_lse = reference_attention(q, k, v, **kw)
    _close(out, ref_out, dtype, "out")
    _close(lse, ref_lse, dtype, "lse", lse=True)
    return out, lse


_BF16_REFUSED = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11)


def _skip_refused_bf16(dtype) -> None:
    """torch < 2.11: bf16 flex on the CPU is refused by a declared limit (checked below)."""
    if dtype == torch.bfloat16 and _BF16_REFUSED:
        pytest.skip("flex bf16 on the CPU is refused before torch 2.11 (test_flex_bf16_cpu_limit_names_the_version)")


def test_flex_bf16_cpu_limit_names_the_version():
    """The declared limit refuses bf16 on the CPU for torch before 2.11, naming the version, and
    nothing else (fp16 there, bf16 from 2.11)."""
    from usp_hal.dispatch.capabilities import RuleContext, declared_reasons
    req = AttnRequest(dtype=torch.bfloat16, device_type="cpu", head_dim=16)
    old = declared_reasons(FlexAttentionBackend, req, RuleContext(torch_version="2.9.1"))
    assert any("torch 2.9.1" in r and "torch >= 2.11" in r for r in old), old
    assert not declared_reasons(FlexAttentionBackend, req, RuleContext(torch_version="2.11.0"))
    fp16 = req.with_(dtype=torch.float16)
    assert not declared_reasons(FlexAttentionBackend, fp16, RuleContext(torch_version="2.9.1"))


def _mask(b, h, sq, sk, seed=1, p=0.6):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, h, sq, sk, generator=g) < p


# Each distinct call structure costs flex one trace (about a second here): the cases are few and mixed.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: IDS[d])
def test_flex_plain_and_causal_gqa(dtype):
    """out and a natural-log lse (flex's base-2 stats scaled back) in every dtype; GQA, Sq != Sk, 13/21 keys."""
    _skip_refused_bf16(dtype)
    _forward_check(dtype, dict(sq=13, sk=21, h=4, hkv=2), causal=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=lambda d: IDS[d])
def test_flex_mask_with_empty_rows(dtype):
    """mask= (B and H broadcast separately) and'ed with causal; rows it empties give out 0, lse -inf."""
    _skip_refused_bf16(dtype)
    b, h, sq, sk = 2, 4, 9, 9
    mask = _mask(b, 1, sq, sk)
    mask[0, 0, 3] = False                        # a row without keys in batch 0 only
    mask[1, 0, :, 0] = True                      # every causal row of batch 1 keeps key 0
    out, lse = _forward_check(dtype, dict(b=b, sq=sq, h=h), causal=True, mask=mask)
    assert torch.isneginf(lse[0, :, 3]).all() and torch.count_nonzero(out[0, 3]) == 0
    assert torch.isfinite(lse[1]).all()


def test_flex_per_head_mask_window_key_offset_gqa():
    """A per-head mask, a two-sided window at a ring key offset and GQA: the mods see global positions."""
    b, h, sq, sk = 1, 4, 12, 20
    mask = _mask(1, h, sq, sk, seed=3, p=0.7)
    _forward_check(torch.float32, dict(b=b, sq=sq, sk=sk, h=h, hkv=1), window=(6, 3), key_offset=-4, mask=mask)


def test_flex_value_head_dim_differs():
    """Dk != Dv (MLA shapes, both ways), GQA, causal with softcap: out has the value head dim."""
    _forward_check(torch.float64, dict(sq=11, h=4, hkv=2, d=24, dv=16), causal=True, softcap=2.0)
    _forward_check(torch.float32, dict(sq=9, sk=14, h=2, d=8, dv=20), window=(3, 2), key_offset=2)


def test_flex_alibi_softcap_across_offset():
    """alibi (per batch and head) and softcap in the score_mod, window at a key offset, length 130 (> one block)."""
    b, h = 2, 2
    slopes = torch.tensor([[0.5, 0.25], [0.125, 1.0]])
    _forward_check(torch.float32, dict(b=b, sq=130, sk=7, h=h, d=8), alibi_slopes=slopes, softcap=1.5,
                   window=(-1, 2), key_offset=125)


def test_flex_no_keys_at_all():
    """Sk = 0 (flex's kernels refuse it): out 0 and lse -inf without calling the kernel."""
    q, k, v, _ = _inputs(torch.float32, sq=5, sk=0)
    out, lse = KERNEL.forward(q, k, v, KernelCall(scale=0.25))
    assert torch.count_nonzero(out) == 0 and torch.isneginf(lse).all()


# --------------------------------------------------------------------------- declared capabilities
def test_flex_cpu_declares_forward_with_lse_and_no_backward():
    base = AttnRequest(dtype=torch.float32, device_type="cpu", head_dim=16, num_heads=4, num_kv_heads=2,
                       causal=True, mask=True, needs_lse=True, key_offset=True, window=(4, 0), alibi=True)
    assert FlexAttentionBackend.not_supported_reasons(base) == []
    why = FlexAttentionBackend.not_supported_reasons(base.with_(needs_grad=True))
    assert any("no backward on CPU" in r for r in why), why
    cuda = base.with_(device_type="cuda", compute_capability=(9, 0), needs_grad=True)
    assert FlexAttentionBackend.not_supported_reasons(cuda) == []
    assert any("at least 16" in r for r in FlexAttentionBackend.not_supported_reasons(cuda.with_(head_dim=8)))


def test_flex_backward_refused_on_cpu_before_the_kernel():
    q, k, v, dout = _inputs(torch.float32, sq=6)
    out, lse = KERNEL.forward(q, k, v, KernelCall(scale=0.25))
    with pytest.raises(Unsupported, match="no backward on CPU"):
        KERNEL.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25))


# --------------------------------------------------------------------------- through the USP core
def test_flex_through_long_context_attention_one_rank():
    """LongContextAttention(attn_type='flex') on one process: forward out and lse vs the reference."""
    dtype = torch.bfloat16 if not _BF16_REFUSED else torch.float16
    q, k, v, _ = _inputs(dtype, b=1, sq=24, h=4, hkv=2, d=16, seed=4)
    attn = usp_hal.LongContextAttention(attn_type="flex")
    with torch.no_grad():
        out, lse = attn(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, causal=True)
    _close(out, ref_out, dtype, "out")
    _close(lse, ref_lse, dtype, "lse", lse=True)


def test_flex_training_call_refused_through_the_core():
    q, k, v, _ = _inputs(torch.float32, b=1, sq=8, h=2, d=16)
    attn = usp_hal.LongContextAttention(attn_type="flex")
    with pytest.raises(NotImplementedError, match="no backward on CPU") as err:
        attn(q.requires_grad_(), k, v, causal=True)
    assert "sdpa" in str(err.value)                 # the refusal names a backend that would run it


# --------------------------------------------------------------------------- the CUDA backward (stand-in)
def _unfused_flex_with_grad(device_type):
    """torch's own uncompiled flex with the CPU backward refusal lifted (its dense autograd);
    static shapes, as the adapter compiles flex on CUDA (its dynamic-shape trace of the
    autograd path fails on torch 2.13 with an unbacked symbol)."""
    flex, create_block_mask, aux = flex_module._eager_ops()
    fa = pytest.importorskip("torch.nn.attention.flex_attention")

    def call(*args, **kw):
        saved = fa._validate_device
        fa._validate_device = lambda *a: None
        try:
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                return flex(*args, **kw)
        finally:
            fa._validate_device = saved
    return call, create_block_mask, aux


@pytest.mark.parametrize("dv", [None, 24], ids=["dv=dk", "dv!=dk"])
def test_flex_backward_reweights_to_the_merged_out_and_lse(monkeypatch, dv):
    """The CUDA backward (emulated): two key blocks' gradients, each from the merged (global)
    out/lse, with a mask, a window and GQA (and a value head dim of its own), sum to the
    float64 reference gradients."""
    dtype = torch.float32
    monkeypatch.setattr(flex_module, "flex_ops", _unfused_flex_with_grad)
    b, h, hkv, sq, sk, d = 1, 4, 2, 10, 16, 16
    q, k, v, dout = _inputs(dtype, b=b, sq=sq, sk=sk, h=h, hkv=hkv, d=d, seed=6, dv=dv)
    mask = _mask(1, 1, sq, sk, seed=7, p=0.7)
    mask[..., 2, :] = False                                  # a row without keys anywhere
    kw = dict(softmax_scale=0.25, window=(8, 8), softcap=2.0)
    with platform.emulate("cuda", compute_capability=(9, 0)):
        out, lse, dq, dk, dv, grads = merged_key_blocks(
            KERNEL, q, k, v, dout, ((0, 7), (7, sk)), lambda a, z: {"key_offset": a, "mask": mask[..., a:z]}, **kw)
    qr, kr, vr = (x.to(torch.float64).requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, mask=mask, **kw)
    ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout.to(torch.float64))
    _close(out, ref_out.detach(), dtype, "merged out")
    _close(lse, ref_lse.detach(), dtype, "merged lse", lse=True)
    _close(dq, ref_grads[0], dtype, "dq")
    _close(dk, ref_grads[1], dtype, "dk")
    _close(dv, ref_grads[2], dtype, "dv")
    assert torch.count_nonzero(grads[0][0][:, 2]) == 0 and torch.count_nonzero(grads[1][0][:, 2]) == 0


def test_flex_mask_mod_through_long_context_attention_one_rank(monkeypatch):
    """LongContextAttention(mask=mask_mod) with attn_type='flex': the core's partial blocks reach flex as
    dense masks (full ones without), and the result matches the float64 reference with the dense mask."""
    seen = []
    kernel = FlexAttentionBackend.kernel_forward

    def record(self, q, k, v, call):
        seen.append(call.mask is not None)
        return kernel(self, q, k, v, call)
    monkeypatch.setattr(FlexAttentionBackend, "kernel_forward", record)
    q, k, v, _ = _inputs(torch.float32, b=1, sq=40, h=4, d=16, seed=8)

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & ((qi - ki) % 3 != 1)
    with torch.no_grad():
        out, lse = usp_hal.LongContextAttention(attn_type="flex")(q, k, v, mask=mask_mod, return_lse=True)
    m = torch.arange(40)
    dense = ((m[None] <= m[:, None]) & ((m[:, None] - m[None]) % 3 != 1)).view(1, 1, 40, 40)
    ref_out, ref_lse = reference_attention(q, k, v, mask=dense)
    _close(out, ref_out, torch.float32, "out")
    _close(lse, ref_lse, torch.float32, "lse", lse=True)
    assert any(seen), "no partial block reached the kernel with a mask"
