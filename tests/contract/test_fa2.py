"""Contract tests for the FlashAttention-2 adapter (``usp_hal.backends.fa2``).

The stand-in follows the real flash-attn sources per version (see standins_fa.py): the
window normalisation of ``mha_fwd`` (right bound ``>= Sk`` -> unbounded), the architecture
checks per version, the backward head-dim rules per architecture, and on ROCm the CK
backend's ignored softcap and the Triton backend's ignored window.

These prove the *adapter*, not the kernel: flash-attn is replaced by stand-in packages
(tests/contract/standins_fa.py) installed under the real import paths with real package
metadata and the real Python signatures of flash-attn 2.5.9, 2.6.3, 2.7.4, 2.8.3 and a
hypothetical 2.10.0 (which must be read as newer than 2.6.3).  The stand-ins compute on
CPU tensors with the kernel's documented quirks: 8-tuple vs 4-tuple forward returns,
returned vs in-place gradients, no softcap before 2.6, head dims that are not a multiple
of 8 rejected from 2.7 on, bottom-right position alignment, the causal ALiBi shift and
lse ``+inf`` for rows without keys.  The adapter's forward/backward are called directly
with CPU tensors (``availability()`` rightly reports that a cuda device is missing) and
compared with the float64 reference of usp_hal.dispatch.reference.  The real kernel runs in the
per-device CI matrices.
"""
from __future__ import annotations

import importlib
import sys
import uuid

import pytest
import torch

import usp_hal.dispatch.platform
import usp_hal.dispatch.registry
from tests.dist_cases import kernel_call, merged_key_blocks
from usp_hal import KernelCall
from usp_hal.backends.fa2 import FlashAttn2Backend
from usp_hal.dispatch.backend import BackendUnavailable, parse_version
from usp_hal.dispatch.capabilities import AttnRequest

from .standin import install_standin, purge_modules
from .standins_fa import (
    FA2_DIST,
    FA2_TOP_LEVEL,
    FA3_DIST,
    FA3_TOP_LEVEL,
    assert_matches,
    fa2_files,
    fa3_files,
    make_inputs,
    reference,
)

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))

VERSIONS = ["2.5.9", "2.6.3", "2.7.4", "2.8.3", "2.10.0"]
DTYPES = [torch.float16, torch.bfloat16]

# name -> (input shape kwargs, call kwargs)
CASES = {
    "plain": (dict(), dict()),
    "gqa": (dict(h=4, hkv=2, d=32), dict()),
    "mqa_causal": (dict(h=4, hkv=1, d=32), dict(causal=True)),
    "causal": (dict(), dict(causal=True)),
    "window": (dict(), dict(window=(3, 2))),
    "causal_window": (dict(d=32), dict(causal=True, window=(4, -1))),
    "softcap": (dict(d=32), dict(softcap=1.5, softmax_scale=0.5)),
    "head_dim_20_gqa_causal": (dict(h=4, hkv=2, d=20), dict(causal=True)),
    "head_dim_72": (dict(d=72), dict()),
    "alibi": (dict(h=4, d=32), dict(alibi="heads")),
    "alibi_causal": (dict(h=4, d=32), dict(alibi="batch_heads", causal=True)),
    "alibi_window_causal": (dict(h=4, d=32), dict(alibi="heads", causal=True, window=(5, -1))),
    "alibi_window_left_only": (dict(h=4, d=32), dict(alibi="heads", window=(-1, 0))),   # kernel's causal path
    "rect_window": (dict(sq=12, sk=20, d=32), dict(window=(4, 10))),
    "rect_causal": (dict(sq=20, sk=12, d=32), dict(causal=True)),
}


@pytest.fixture
def fa2(tmp_path, monkeypatch):
    """install(version, **files_kw) -> a fresh FlashAttn2Backend over that stand-in."""
    def install(version, **kw):
        install_standin(tmp_path, monkeypatch, dist=FA2_DIST, version=version, files=fa2_files(version, **kw))
        return FlashAttn2Backend()
    yield install
    purge_modules(FA2_TOP_LEVEL)


def _slopes(kind, b, h):
    base = torch.tensor([0.5 ** (i + 1) for i in range(h)], dtype=torch.float32)
    return base if kind == "heads" else torch.stack([base * (1 + 0.5 * i) for i in range(b)])


def _call_kwargs(call, b, h, d):
    kw = dict(call)
    kw.setdefault("softmax_scale", d ** -0.5)
    alibi = kw.pop("alibi", None)
    kw["alibi_slopes"] = _slopes(alibi, b, h) if alibi else None
    return kw


# --------------------------------------------------------------------------- forward + backward
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("version", VERSIONS)
def test_contract_fa2_matches_reference(fa2, version, case, dtype):
    """contract: out, lse and dq/dk/dv of every API generation match the float64 reference."""
    shape, call = CASES[case]
    backend = fa2(version)
    q, k, v, dout = make_inputs(dtype=dtype, **shape)
    kw = _call_kwargs(call, q.shape[0], q.shape[2], q.shape[-1])
    if kw.get("softcap") and version == "2.5.9":
        with pytest.raises(NotImplementedError, match=r"softcap needs flash-attn >= 2\.6\.0"):
            backend.forward(q, k, v, kernel_call(**kw))
        return
    out, lse = backend.forward(q, k, v, kernel_call(**kw))
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, **kw)
    assert_matches(out, ref_out, dtype, "out")
    assert_matches(lse, ref_lse, dtype, "lse")
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, kernel_call(**kw))
    for name, got, want, like in (("dq", dq, ref_dq, q), ("dk", dk, ref_dk, k), ("dv", dv, ref_dv, v)):
        assert got.shape == like.shape and got.dtype == dtype, name
        assert_matches(got, want, dtype, name)


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
def test_contract_fa2_ring_merged_out_lse_in_backward(fa2, version):
    """contract: backward given the merged (global) out/lse of two key blocks sums to the reference grads."""
    dtype = torch.float16
    backend = fa2(version)
    q, k, v, dout = make_inputs(sk=24, h=4, hkv=2, d=40, dtype=dtype, seed=3)
    scale = 40 ** -0.5
    out, lse, dq, dk, dv, _ = merged_key_blocks(backend, q, k, v, dout, ((0, 10), (10, 24)), softmax_scale=scale)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, softmax_scale=scale)
    assert_matches(out, ref_out, dtype, "merged out")
    assert_matches(lse, ref_lse, dtype, "merged lse")
    assert_matches(dq, ref_dq, dtype, "dq")
    assert_matches(dk, ref_dk, dtype, "dk")
    assert_matches(dv, ref_dv, dtype, "dv")


@pytest.mark.parametrize("version", ["2.5.9", "2.8.3"])
def test_contract_fa2_minus_inf_rows_contribute_nothing(fa2, version):
    """contract: rows whose (global) lse is -inf give zero dq and add nothing to dk/dv."""
    dtype = torch.float16
    backend = fa2(version)
    q, k, v, dout = make_inputs(d=32, dtype=dtype, seed=5)
    scale = 32 ** -0.5
    out, lse = backend.forward(q, k, v, KernelCall(scale=scale))
    dead = torch.zeros(q.shape[1], dtype=torch.bool)
    dead[[1, 6, 7]] = True
    lse = lse.masked_fill(dead.view(1, 1, -1), float("-inf"))
    out = out.masked_fill(dead.view(1, -1, 1, 1), 0)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=scale))
    # the same rows with zero upstream gradient in the reference contribute nothing
    _, _, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout.masked_fill(dead.view(1, -1, 1, 1), 0),
                                             softmax_scale=scale)
    assert torch.count_nonzero(dq[:, dead]) == 0
    assert_matches(dq, ref_dq, dtype, "dq")
    assert_matches(dk, ref_dk, dtype, "dk")
    assert_matches(dv, ref_dv, dtype, "dv")


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
def test_contract_fa2_no_key_rows_lse_plus_inf_becomes_minus_inf(fa2, version):
    """contract: the kernel's +inf lse for rows without keys comes back as -inf (out 0)."""
    backend = fa2(version)
    iface = importlib.import_module("flash_attn.flash_attn_interface")
    q, k, v, _ = make_inputs(sq=8, sk=4, d=16, dtype=torch.float16)
    # the stand-in really writes +inf: bottom-right causal with Sq > Sk leaves rows 0..3 keyless
    split = parse_version(version) >= parse_version("2.7")
    kw = dict(window_size_left=-1, window_size_right=-1) if split else dict(window_size=(-1, -1))
    res = iface._flash_attn_forward(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=0.25, causal=True,
                                    softcap=0.0, alibi_slopes=None, return_softmax=False, **kw)
    raw_lse = res[1] if len(res) == 4 else res[5]
    assert torch.isposinf(raw_lse[..., :4]).all() and torch.isfinite(raw_lse[..., 4:]).all()
    # through the adapter: no keys at all -> every row keyless
    empty_k, empty_v = k[:, :0], v[:, :0]
    out, lse = backend.forward(q, empty_k, empty_v, KernelCall(scale=0.25))
    ref_out, ref_lse, *_ = reference(q, empty_k, empty_v, torch.zeros_like(q), softmax_scale=0.25)
    assert torch.isneginf(lse).all() and torch.isneginf(ref_lse).all()
    assert torch.count_nonzero(out) == 0
    assert_matches(out, ref_out, torch.float16, "out")


@pytest.mark.parametrize("version", ["2.7.4", "2.10.0"])
def test_contract_fa2_pads_head_dim_that_the_kernel_rejects(fa2, version):
    """contract: >= 2.7 rejects head_dim % 8 != 0 at the low-level call; the adapter pads."""
    backend = fa2(version)
    iface = importlib.import_module("flash_attn.flash_attn_interface")
    q, k, v, dout = make_inputs(d=20, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        iface._flash_attn_forward(q, k, v, 0.0, 0.2, False, -1, -1, 0.0, None, False)
    out, lse = backend.forward(q, k, v, KernelCall(scale=None))          # default scale: 1/sqrt(20)
    ref_out, ref_lse, *_ = reference(q, k, v, dout, softmax_scale=20 ** -0.5)
    assert out.shape == q.shape
    assert_matches(out, ref_out, torch.bfloat16, "out")
    assert_matches(lse, ref_lse, torch.bfloat16, "lse")


def test_contract_fa2_version_parsed_numerically(fa2):
    """contract: "2.10.0" selects the >= 2.7 API (a string comparison would call it older than 2.6.3)."""
    assert "2.10.0" < "2.6.3"        # why string comparison is wrong
    backend = fa2("2.10.0")
    assert backend._kernel().split_window
    purge_modules(FA2_TOP_LEVEL)
    backend = fa2("2.6.3")
    assert not backend._kernel().split_window and backend._kernel().has_softcap


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
def test_contract_fa2_deterministic_reaches_the_kernel(fa2, version):
    """contract: deterministic=True is passed to the backward kernel."""
    backend = fa2(version)
    q, k, v, dout = make_inputs(d=16, dtype=torch.float16)
    out, lse = backend.forward(q, k, v, KernelCall(scale=0.25))
    backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25, deterministic=True))
    backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25, deterministic=False))
    calls = importlib.import_module("flash_attn_2_cuda").BWD_CALLS
    assert [c["deterministic"] for c in calls] == [True, False]


# --------------------------------------------------------------------------- refusals
def test_contract_fa2_refuses_what_it_cannot_do(fa2):
    """contract: unsupported calls raise with the reason (read from the declarations), never run."""
    backend = fa2("2.8.3")
    q, k, v, dout = make_inputs(d=32, dtype=torch.float16)
    s = 32 ** -0.5
    # made directly, the refusal gives the reasons and points to the probe; made as the
    # package makes it (Registry.instance), it also names the backends that would run the call
    with pytest.raises(NotImplementedError, match=r"dtype=fp32[\s\S]*usp-hal probe"):
        backend.forward(q.float(), k.float(), v.float(), KernelCall(scale=s))
    backend.registry = usp_hal.dispatch.registry.REGISTRY
    with pytest.raises(NotImplementedError, match="dropout_p=0.1 not supported"):
        backend.forward(q, k, v, KernelCall(scale=s, dropout_p=0.1))
    with pytest.raises(NotImplementedError, match=r"dtype=fp32[\s\S]*sdpa"):
        backend.forward(q.float(), k.float(), v.float(), KernelCall(scale=s))
    big = make_inputs(d=264, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="head_dim=264"):
        backend.forward(*big[:3], KernelCall(scale=s))
    with pytest.raises(NotImplementedError, match="window/alibi across ring blocks"):
        backend.forward(q, k, v, KernelCall(scale=s, window=(4, 0), key_offset=16))
    # causal with a key offset is the contract's block-local causal: key_offset only moves windows/alibi
    out, _ = backend.forward(q, k, v, KernelCall(scale=s, causal=True, key_offset=16))
    assert_matches(out, reference(q, k, v, dout, softmax_scale=s, causal=True)[0], torch.float16, "out")
    q2, k2, v2, _ = make_inputs(sq=12, sk=20, d=32, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="bottom-right"):
        backend.forward(q2, k2, v2, KernelCall(scale=s, window=(4, 2)))      # would need right = -6
    with pytest.raises(NotImplementedError, match="alibi"):
        backend.forward(q2, k2, v2, KernelCall(scale=s, alibi_slopes=torch.ones(4)))
    with pytest.raises(NotImplementedError, match="bottom-right"):
        backend.forward(q2, k2, v2, KernelCall(scale=s, causal=True))        # top-left causal, Sk > Sq
    with pytest.raises(ValueError, match=r"lse must be \[B, H, Sq\]"):
        backend.backward(dout, q, k, v, q, torch.zeros(2, 16, 4), KernelCall(scale=s))
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        backend.forward(q, k, v, KernelCall(scale=s, alibi_slopes=torch.ones(3)))


def test_contract_fa2_declared_rules_reach_the_core():
    """contract: the core's ring request with a window is refused from the declarations alone."""
    ring = AttnRequest(dtype=torch.float16, device_type="cuda", window=(128, 0), key_offset=True)
    assert any("ring blocks" in r for r in FlashAttn2Backend.not_supported_reasons(ring))
    assert not FlashAttn2Backend.not_supported_reasons(ring.with_(key_offset=False))
    assert not FlashAttn2Backend.not_supported_reasons(ring.with_(device_type="rocm", key_offset=False))
    assert FlashAttn2Backend.not_supported_reasons(ring.with_(key_offset=False, compute_capability=(7, 5)))


def test_contract_fa2_softcap_reason_depends_on_installed_version(fa2):
    """contract: softcap is refused for flash-attn 2.5.x (version-dependent reason), allowed from 2.6."""
    req = AttnRequest(dtype=torch.bfloat16, device_type="cuda", softcap=30.0)
    fa2("2.5.9")
    assert FlashAttn2Backend.not_supported_reasons(req) == ["softcap needs flash-attn >= 2.6.0 (installed: 2.5.9)"]
    purge_modules(FA2_TOP_LEVEL)
    fa2("2.10.0")
    assert FlashAttn2Backend.not_supported_reasons(req) == []


# --------------------------------------------------------------------------- availability
def _only_cpu(monkeypatch):
    monkeypatch.setattr(usp_hal.dispatch.platform, "available_device_types", lambda: ("cpu",))


def _cuda(monkeypatch, cc):
    monkeypatch.setattr(usp_hal.dispatch.platform, "available_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(usp_hal.dispatch.platform, "compute_capability", lambda dev, index=0: cc)


def test_contract_fa2_availability_not_installed(monkeypatch):
    """contract: without flash-attn, availability names the package and the extra to install."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(FA2_DIST)
        pytest.skip("a real flash-attn is installed here")
    except PackageNotFoundError:
        pass
    _only_cpu(monkeypatch)
    avail = FlashAttn2Backend.availability()
    assert not avail.ok
    assert avail.reason == "flash-attn not installed (pip install 'usp-hal[fa2]')"
    with pytest.raises(BackendUnavailable, match="flash-attn not installed"):
        q, k, v, _ = make_inputs(d=16, dtype=torch.float16)
        FlashAttn2Backend().forward(q, k, v, KernelCall(scale=0.25))


def test_contract_fa2_availability_metadata_without_extension(fa2, monkeypatch):
    """contract: metadata alone is not enough: the flash_attn_2_cuda extension must be there,
    and the reason says so (and how a Triton AMD build is run), before the missing device."""
    fa2("2.8.3", with_extension=False)
    _only_cpu(monkeypatch)
    monkeypatch.delenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", raising=False)
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and avail.version == "2.8.3"
    assert "without its CUDA extension flash_attn_2_cuda" in avail.reason
    assert "FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE" in avail.reason


# --------------------------------------------------------------------------- the Triton AMD build
def _find_spec_with(monkeypatch, **present):
    """importlib.util.find_spec, with the top-level modules in ``present`` forced found/absent."""
    import importlib.util
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in present:
            return real("json") if present[name] else None
        return real(name, *args)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_contract_fa2_triton_amd_build_is_detected(fa2, monkeypatch):
    """A Triton AMD install has no flash_attn_2_cuda: it is available with the variable set
    (and triton installed), and each missing piece is named otherwise."""
    fa2("2.8.3", with_extension=False, triton_amd=True)
    monkeypatch.setattr(usp_hal.dispatch.platform, "available_device_types", lambda: ("rocm", "cpu"))
    monkeypatch.setattr(usp_hal.dispatch.platform, "compute_capability", lambda dev, index=0: None)
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    _find_spec_with(monkeypatch, triton=True)
    avail = FlashAttn2Backend.availability()
    assert avail.ok and avail.version == "2.8.3" and avail.details == {"device": "rocm"}, avail
    assert not {"flash_attn", "flash_attn.flash_attn_interface"} & set(sys.modules), "detection imported it"
    _find_spec_with(monkeypatch, triton=False)
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and "needs triton" in avail.reason
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE")
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and "without its CUDA extension" in avail.reason


def test_contract_fa2_triton_amd_variable_without_the_backend(fa2, monkeypatch):
    fa2("2.8.3")                                   # a CUDA build: no flash_attn_triton_amd
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and "has no Triton AMD backend" in avail.reason


@pytest.mark.parametrize("device", ["rocm", "cuda"])
def test_contract_fa2_triton_amd_runs_with_its_limits(fa2, monkeypatch, device):
    """The Triton AMD kernels serve plain, causal, GQA calls and the backward exactly; the window
    and softcap they ignore are refused on any device while the variable is set."""
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    backend = fa2("2.8.3", with_extension=False, triton_amd=True)
    q, k, v, dout = make_inputs(h=4, hkv=2, d=40, dtype=torch.float16, seed=5)
    with usp_hal.dispatch.platform.emulate(device):
        for causal in (False, True):
            out, lse = backend.forward(q, k, v, KernelCall(scale=0.3, causal=causal))
            grads = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.3, causal=causal))
            ref = reference(q, k, v, dout, softmax_scale=0.3, causal=causal)
            for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
                assert_matches(got, want, torch.float16, name)
        assert backend._kernel().triton_amd
        for kw, needle in ((dict(window=(4, 0)), "takes the window and ignores it"),
                           (dict(softcap=2.0), "takes softcap and ignores it")):
            with pytest.raises(NotImplementedError, match=needle):
                backend.forward(q, k, v, KernelCall(scale=0.3, **kw))


def test_contract_fa2_variable_changed_after_import_is_refused(fa2, monkeypatch):
    """The kernel module is chosen when flash_attn_interface is imported; the declared limits follow
    the variable: a mismatch would serve windows the kernel ignores, so it is refused."""
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    backend = fa2("2.8.3", triton_amd=True)
    q, k, v, _ = make_inputs(d=32, dtype=torch.float16)
    with usp_hal.dispatch.platform.emulate("rocm"):
        backend.forward(q, k, v, KernelCall(scale=0.3))
        monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE")
        with pytest.raises(BackendUnavailable, match="imported with its Triton AMD kernels"):
            backend.forward(q, k, v, KernelCall(scale=0.3, window=(4, 0)))


def test_contract_fa2_availability_too_old(fa2, monkeypatch):
    """contract: versions older than the adapter's minimum are refused with the version."""
    fa2("2.4.2")
    _only_cpu(monkeypatch)
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and avail.reason == "flash-attn 2.4.2 too old (needs >= 2.5.0)"


def test_contract_fa2_availability_needs_cuda_and_never_imports(fa2, monkeypatch):
    """contract: installed but no cuda device -> that reason; detection imports no kernel package."""
    fa2("2.8.3")
    _only_cpu(monkeypatch)
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and avail.version == "2.8.3"
    assert avail.reason == "needs a cuda/rocm device, found cpu"
    req = AttnRequest(dtype=torch.float16, device_type="cuda", softcap=10.0)
    FlashAttn2Backend.not_supported_reasons(req)
    FlashAttn2Backend.capabilities()
    assert not {"flash_attn", "flash_attn_2_cuda", "flash_attn.flash_attn_interface"} & set(sys.modules)


def test_contract_fa2_availability_compute_capability(fa2, monkeypatch):
    """contract: a cuda device below sm80 is refused with both capabilities named; sm80 is fine."""
    fa2("2.8.3")
    _cuda(monkeypatch, (7, 5))
    avail = FlashAttn2Backend.availability()
    assert not avail.ok and avail.reason == "needs cuda compute capability >= 8.0, found 7.5"
    _cuda(monkeypatch, (8, 0))
    avail = FlashAttn2Backend.availability()
    assert avail.ok and avail.version == "2.8.3" and avail.details == {"device": "cuda"}


# --------------------------------------------------------------------------- the real kernel's quirks
def test_contract_fa2_right_bound_dropped_by_the_kernel_is_refused(fa2):
    """mha_fwd turns a right bound >= Sk into "unbounded": for Sq=24, Sk=12 causal, the
    bottom-right translation needs right bound 12 = Sk, so the kernel would attend to keys
    causal excludes.  The stand-in does exactly that; the adapter refuses instead."""
    backend = fa2("2.8.3")
    q, k, v, dout = make_inputs(sq=24, sk=12, d=32, dtype=torch.float16)
    iface = importlib.import_module("flash_attn.flash_attn_interface")
    raw_out = iface._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, 12, 0.0, None, False)[0]
    ref_out = reference(q, k, v, dout, softmax_scale=0.25, causal=True)[0]
    assert (raw_out.double() - ref_out).abs().max() > 0.5, "the stand-in must reproduce the dropped bound"
    with pytest.raises(NotImplementedError, match="treats as unbounded"):
        backend.forward(q, k, v, KernelCall(scale=0.25, causal=True))
    with pytest.raises(NotImplementedError, match="treats as unbounded"):
        backend.forward(q, k, v, KernelCall(scale=0.25, window=(-1, 2)))       # right' = 14 >= Sk, < Sq - 1
    # expressible neighbours still run exactly: Sq = Sk + 1 (the bound only excludes the last key
    # from the first row, which the kernel's bound would do too), and a right bound below Sk
    q1, k1, v1, d1 = make_inputs(sq=13, sk=12, d=32, dtype=torch.float16)
    out, _ = backend.forward(q1, k1, v1, KernelCall(scale=0.25, causal=True))
    assert_matches(out, reference(q1, k1, v1, d1, softmax_scale=0.25, causal=True)[0], torch.float16, "out")
    out, _ = backend.forward(q, k, v, KernelCall(scale=0.25, window=(-1, -10)))


def test_contract_fa2_right_bound_rule_is_declared_for_dispatch():
    req = AttnRequest(dtype=torch.float16, device_type="cuda", causal=True, seqlen_q=24, seqlen_k=12)
    assert any("treats as unbounded" in r for r in FlashAttn2Backend.not_supported_reasons(req))
    assert not FlashAttn2Backend.not_supported_reasons(req.with_(seqlen_q=12))


def test_contract_fa2_rocm_ck_ignores_softcap(fa2):
    """flash-attn's CK backend (ROCm) takes softcap and drops it: softcap is refused on rocm."""
    fa2("2.8.3")
    with usp_hal.dispatch.platform.emulate("rocm"):
        q, k, v, dout = make_inputs(d=32, dtype=torch.float16)
        iface = importlib.import_module("flash_attn.flash_attn_interface")
        raw = iface._flash_attn_forward(q, k, v, 0.0, 0.5, False, -1, -1, 1.5, None, False)[0]
        plain = reference(q, k, v, dout, softmax_scale=0.5)[0]
        assert_matches(raw, plain, torch.float16, "CK output equals the output without softcap")
        req = AttnRequest(dtype=torch.float16, device_type="rocm", softcap=1.5)
        assert any("CK backend takes softcap and ignores it" in r for r in FlashAttn2Backend.not_supported_reasons(req))
        with pytest.raises(NotImplementedError, match="ignores it"):
            FlashAttn2Backend().forward(q, k, v, KernelCall(scale=0.5, softcap=1.5))
        out, _ = FlashAttn2Backend().forward(q, k, v, KernelCall(scale=0.5))        # the rest runs on ROCm
        assert_matches(out, plain, torch.float16, "out")
    cuda = AttnRequest(dtype=torch.float16, device_type="cuda", softcap=1.5)
    assert FlashAttn2Backend.not_supported_reasons(cuda) == []


def test_contract_fa2_rocm_triton_ignores_the_window(fa2, monkeypatch):
    fa2("2.8.3")
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    req = AttnRequest(dtype=torch.bfloat16, device_type="rocm", window=(4, 0))
    assert any("Triton AMD backend takes the window and ignores it" in r
               for r in FlashAttn2Backend.not_supported_reasons(req))
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE")
    assert FlashAttn2Backend.not_supported_reasons(req) == []


@pytest.mark.parametrize("version,cc,ok", [
    ("2.7.2", (10, 0), False), ("2.7.2", (12, 0), False), ("2.7.2", (8, 9), True), ("2.7.2", (9, 0), True),
    ("2.7.4", (10, 0), True), ("2.8.3", (12, 0), True),
])
def test_contract_fa2_architectures_per_version(fa2, version, cc, ok):
    """flash-attn <= 2.7.2 runs on sm8x and sm90 only; 2.7.3 accepts any major >= 8."""
    backend = fa2(version)
    with usp_hal.dispatch.platform.emulate("cuda", compute_capability=cc):
        q, k, v, _ = make_inputs(d=32, dtype=torch.float16)
        req = AttnRequest(dtype=torch.float16, device_type="cuda", compute_capability=cc)
        reasons = FlashAttn2Backend.not_supported_reasons(req)
        iface = importlib.import_module("flash_attn.flash_attn_interface")
        if ok:
            assert reasons == [] and FlashAttn2Backend.availability().ok
            backend.forward(q, k, v, KernelCall(scale=0.2))
            return
        assert any("runs on sm8x and sm90 only" in r for r in reasons), reasons
        assert "runs on sm8x and sm90 only" in FlashAttn2Backend.availability().reason
        with pytest.raises(RuntimeError, match="only supports Ampere GPUs or newer"):
            iface._flash_attn_forward(q, k, v, 0.0, 0.2, False, -1, -1, 0.0, None, False)
        with pytest.raises(NotImplementedError, match="sm8x and sm90 only"):
            backend.forward(q, k, v, KernelCall(scale=0.2))


@pytest.mark.parametrize("version,head_dim,cc,ok", [
    ("2.5.0", 200, (8, 6), False), ("2.5.0", 192, (8, 6), True), ("2.5.0", 200, (8, 0), True),
    ("2.6.1", 216, (8, 9), False), ("2.6.1", 240, (8, 9), True), ("2.6.3", 216, (8, 9), True),
])
def test_contract_fa2_backward_head_dims_per_architecture(fa2, version, head_dim, cc, ok):
    """2.5.0-2.5.4: backward with head dim > 192 needs sm80/sm90; 2.5.5-2.6.1: 193..224 does."""
    backend = fa2(version)
    with usp_hal.dispatch.platform.emulate("cuda", compute_capability=cc):
        q, k, v, dout = make_inputs(sq=8, sk=8, h=2, hkv=2, d=head_dim, dtype=torch.float16)
        out, lse = backend.forward(q, k, v, KernelCall(scale=0.1))
        req = AttnRequest(dtype=torch.float16, device_type="cuda", head_dim=head_dim, needs_grad=True,
                          compute_capability=cc)
        reasons = FlashAttn2Backend.not_supported_reasons(req)
        if ok:
            assert reasons == []
            backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.1))
            return
        assert any("needs sm80 or sm90" in r for r in reasons), reasons
        with pytest.raises(NotImplementedError, match="needs sm80 or sm90"):
            backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.1))
        ext = importlib.import_module("flash_attn_2_cuda")
        with pytest.raises(RuntimeError, match="requires A100/A800 or H100/H800"):
            ext.bwd(*(x.contiguous() for x in (dout, q, k, v, out)), lse, None, None, None, None, 0.0, 0.1,
                    False, -1, -1, *((0.0,) if parse_version(version) >= parse_version("2.6.0") else ()),
                    False, None, None)


def test_contract_fa2_refuses_an_operator_another_package_replaced(tmp_path, monkeypatch, fa2):
    """With a FlashAttention-3 build that registers the same operator name imported after
    flash-attn >= 2.7, the name runs FA3's kernel: the loader detects it and refuses."""
    ns = "clash_" + uuid.uuid4().hex[:8]
    install_standin(tmp_path / "fa2", monkeypatch, dist=FA2_DIST, version="2.8.3",
                    files=fa2_files("2.8.3", op_namespace=ns))
    importlib.import_module("flash_attn.flash_attn_interface")
    install_standin(tmp_path / "fa3", monkeypatch, dist=FA3_DIST, version="3.0.0b1",
                    files=fa3_files("new", op_namespace=ns))
    try:
        importlib.import_module("flash_attn_interface")        # FA3 replaces the operator
        q, k, v, _ = make_inputs(d=32, dtype=torch.float16)
        with pytest.raises(BackendUnavailable, match="now belongs to another package"):
            FlashAttn2Backend().forward(q, k, v, KernelCall(scale=0.2))
    finally:
        purge_modules(FA3_TOP_LEVEL)


def test_contract_fa2_triton_amd_varlen_lse_and_alibi(fa2, monkeypatch):
    """The Triton AMD kernels lay the varlen lse out [total_q, H] (forward and backward) and add
    ALiBi as -slope * |distance| on the causal path too, with [B, H] slopes only: the adapter
    converts the lse both ways and applies no causal-path shift there."""
    from usp_hal.parallel.ring import Packing
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    backend = fa2("2.8.3", with_extension=False, triton_amd=True)
    q, k, v, dout = make_inputs(b=2, h=4, d=32, dtype=torch.float16, seed=6)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    with usp_hal.dispatch.platform.emulate("rocm"):
        out, lse = backend.forward(q, k, v, KernelCall(scale=0.3, causal=True, alibi_slopes=slopes))
        grads = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.3, causal=True, alibi_slopes=slopes))
        ref = reference(q, k, v, dout, softmax_scale=0.3, causal=True, alibi_slopes=slopes)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
            assert_matches(got, want, torch.float16, name)
        lens = [5, 11]
        packing = Packing(lens, lens, q.device)
        qp, kp, vp, dp = (x[0, :16] for x in (q, k, v, dout))
        out, lse = backend.forward_packed(qp, kp, vp, KernelCall(packing=packing, scale=0.3, causal=True))
        assert lse.shape == (4, 16)
        grads = backend.backward_packed(dp, qp, kp, vp, out, lse, KernelCall(packing=packing, scale=0.3, causal=True))
        for a, b in ((0, 5), (5, 16)):
            ref = reference(qp[None, a:b], kp[None, a:b], vp[None, a:b], dp[None, a:b], softmax_scale=0.3,
                            causal=True)
            got = (out[a:b], lse[:, a:b], *(g[a:b] for g in grads))
            for name, x, want in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
                assert_matches(x[None] if name != "lse" else x[None], want, torch.float16, name)
