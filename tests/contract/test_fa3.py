"""Contract tests for the FlashAttention-3 adapter (``usp_hal.backends.fa3``).

These prove the *adapter*, not the kernel: FA3 is replaced by stand-in packages
(tests/contract/standins_fa.py) installed under the real import paths
(``flash_attn_interface`` and ``flash_attn_3``) with real package metadata and the real
signatures of both API generations: the old one (``window_size=(l, r)``, required
positional arguments, gradients returned) and the custom-op one (``window_size_left/right``,
``is_causal``/``sequed_q``, gradients written in place).  The stand-ins compute on CPU
tensors with FA3's documented behaviour (fp16/bf16, head dims multiple of 8, bottom-right
alignment, lse ``-inf`` for a row without keys and ``+inf`` when there are no keys).
The adapter's forward/backward are called directly with CPU tensors (``availability()``
rightly reports that a cuda device is missing) and compared with the float64 reference of
usp_hal.dispatch.reference.  The real kernel runs in the per-device CI matrices (sm90).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import usp_hal.dispatch.platform
import usp_hal.dispatch.registry
from tests.dist_cases import kernel_call, merged_key_blocks
from usp_hal import KernelCall
from usp_hal.backends.fa3 import FlashAttn3Backend
from usp_hal.dispatch.backend import BackendUnavailable
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

APIS = ["old", "new"]
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
    "softcap_window_gqa": (dict(h=4, hkv=2, d=32), dict(softcap=2.0, window=(2, 2))),
    "head_dim_20_gqa_causal": (dict(h=4, hkv=2, d=20), dict(causal=True)),
    "head_dim_72": (dict(d=72), dict()),
    "rect_window": (dict(sq=12, sk=20, d=32), dict(window=(4, 10))),
    "rect_causal": (dict(sq=20, sk=12, d=32), dict(causal=True)),
    "mla_192_128": (dict(h=2, hkv=1, d=192, dv=128, sq=9, sk=9), dict(causal=True)),
    "mla_20_44_padded": (dict(d=20, dv=44), dict(causal=True, softcap=1.5)),
}


@pytest.fixture
def fa3(tmp_path, monkeypatch):
    """install(api, **files_kw) -> a fresh FlashAttn3Backend over that stand-in."""
    def install(api, version="3.0.0b1", **kw):
        install_standin(tmp_path, monkeypatch, dist=FA3_DIST, version=version, files=fa3_files(api, **kw))
        return FlashAttn3Backend()
    yield install
    purge_modules(FA3_TOP_LEVEL)


def _check_against_reference(backend, dtype, shape, call):
    shape = dict(shape)
    dv = shape.pop("dv", None)
    q, k, v, dout = make_inputs(dtype=dtype, **shape)
    if dv is not None:          # a value head dim of its own (MLA)
        g = torch.Generator().manual_seed(5)
        v = torch.randn(*v.shape[:3], dv, generator=g).to(dtype)
        dout = torch.randn(*dout.shape[:3], dv, generator=g).to(dtype)
    kw = dict(call)
    kw.setdefault("softmax_scale", q.shape[-1] ** -0.5)
    out, lse = backend.forward(q, k, v, kernel_call(**kw))
    assert out.shape == dout.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, **kw)
    assert_matches(out, ref_out, dtype, "out")
    assert_matches(lse, ref_lse, dtype, "lse")
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, kernel_call(**kw))
    for name, got, want, like in (("dq", dq, ref_dq, q), ("dk", dk, ref_dk, k), ("dv", dv, ref_dv, v)):
        assert got.shape == like.shape and got.dtype == dtype, name
        assert_matches(got, want, dtype, name)


# --------------------------------------------------------------------------- forward + backward
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("api", APIS)
def test_contract_fa3_matches_reference(fa3, api, case, dtype):
    """contract: out, lse and dq/dk/dv of both API generations match the float64 reference."""
    backend = fa3(api)
    assert backend._kernel().api == api      # generation read from the signatures
    _check_against_reference(backend, dtype, *CASES[case])


@pytest.mark.parametrize("api", APIS)
def test_contract_fa3_imports_the_package_path_too(fa3, api):
    """contract: without the top-level module the adapter uses flash_attn_3.flash_attn_interface."""
    backend = fa3(api, top_level=False)
    assert importlib.util.find_spec("flash_attn_interface") is None
    _check_against_reference(backend, torch.float16, dict(h=4, hkv=2, d=24), dict(causal=True))
    assert "flash_attn_3.flash_attn_interface" in sys.modules


@pytest.mark.parametrize("api", APIS)
def test_contract_fa3_ring_merged_out_lse_in_backward(fa3, api):
    """contract: backward given the merged (global) out/lse of two key blocks sums to the reference grads."""
    dtype = torch.bfloat16
    backend = fa3(api)
    q, k, v, dout = make_inputs(sk=24, h=4, hkv=2, d=40, dtype=dtype, seed=3)
    scale = 40 ** -0.5
    out, lse, dq, dk, dv, _ = merged_key_blocks(backend, q, k, v, dout, ((0, 10), (10, 24)), softmax_scale=scale)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, softmax_scale=scale)
    assert_matches(out, ref_out, dtype, "merged out")
    assert_matches(lse, ref_lse, dtype, "merged lse")
    assert_matches(dq, ref_dq, dtype, "dq")
    assert_matches(dk, ref_dk, dtype, "dk")
    assert_matches(dv, ref_dv, dtype, "dv")


@pytest.mark.parametrize("api", APIS)
def test_contract_fa3_minus_inf_rows_contribute_nothing(fa3, api):
    """contract: rows whose (global) lse is -inf give zero dq and add nothing to dk/dv."""
    dtype = torch.float16
    backend = fa3(api)
    q, k, v, dout = make_inputs(d=32, dtype=dtype, seed=5)
    scale = 32 ** -0.5
    out, lse = backend.forward(q, k, v, KernelCall(scale=scale))
    dead = torch.zeros(q.shape[1], dtype=torch.bool)
    dead[[0, 9]] = True
    lse = lse.masked_fill(dead.view(1, 1, -1), float("-inf"))
    out = out.masked_fill(dead.view(1, -1, 1, 1), 0)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, KernelCall(scale=scale))
    _, _, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout.masked_fill(dead.view(1, -1, 1, 1), 0),
                                             softmax_scale=scale)
    assert torch.count_nonzero(dq[:, dead]) == 0
    assert_matches(dq, ref_dq, dtype, "dq")
    assert_matches(dk, ref_dk, dtype, "dk")
    assert_matches(dv, ref_dv, dtype, "dv")


@pytest.mark.parametrize("api", APIS)
def test_contract_fa3_rows_without_keys_have_minus_inf_lse(fa3, api):
    """contract: lse is -inf for keyless rows (FA3 writes -inf there, +inf when Sk == 0)."""
    backend = fa3(api)
    q, k, v, _ = make_inputs(sq=8, sk=4, d=16, dtype=torch.float16)
    c_ext = importlib.import_module("flash_attn_3._C")
    args = [q, k, v] + [None] * 20 + [0.25, True, -1, -1, 0, 0.0, True, None, 1, None, 0]
    raw_out, raw_lse, *_ = c_ext.fwd(*args)       # bottom-right causal, Sq > Sk: rows 0..3 keyless
    assert torch.isneginf(raw_lse[..., :4]).all() and torch.isfinite(raw_lse[..., 4:]).all()
    empty_k, empty_v = k[:, :0], v[:, :0]
    out, lse = backend.forward(q, empty_k, empty_v, KernelCall(scale=0.25))
    assert torch.isneginf(lse).all() and torch.count_nonzero(out) == 0


@pytest.mark.parametrize("api", APIS)
def test_contract_fa3_deterministic_reaches_the_kernel(fa3, api):
    """contract: deterministic=True is passed to the backward kernel."""
    backend = fa3(api)
    q, k, v, dout = make_inputs(d=16, dtype=torch.float16)
    out, lse = backend.forward(q, k, v, KernelCall(scale=0.25))
    backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25, deterministic=True))
    backend.backward(dout, q, k, v, out, lse, KernelCall(scale=0.25, deterministic=False))
    calls = importlib.import_module("flash_attn_3._C").BWD_CALLS
    assert [c["deterministic"] for c in calls] == [True, False]


def test_contract_fa3_unknown_api_is_refused(fa3, tmp_path, monkeypatch):
    """contract: an interface whose signatures match neither generation is refused, not guessed."""
    files = fa3_files("new")
    files["flash_attn_interface.py"] = (   # the 2024 shape: (out, q, k, v, out_padded, lse, ...)
        "def _flash_attn_forward(q, k, v, softmax_scale, causal, descale_q=None):\n"
        "    raise AssertionError('must not be called')\n\n\n"
        "def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):\n"
        "    raise AssertionError('must not be called')\n")
    install_standin(tmp_path, monkeypatch, dist=FA3_DIST, version="3.0.0b1", files=files)
    q, k, v, _ = make_inputs(d=16, dtype=torch.float16)
    with pytest.raises(BackendUnavailable, match="unrecognised flash_attn_interface API"):
        FlashAttn3Backend().forward(q, k, v, KernelCall(scale=0.25))


# --------------------------------------------------------------------------- refusals
def test_contract_fa3_refuses_what_it_cannot_do(fa3):
    """contract: unsupported calls raise with the reason (read from the declarations), never run."""
    backend = fa3("new")
    q, k, v, dout = make_inputs(d=32, dtype=torch.float16)
    s = 32 ** -0.5
    # made directly, the refusal gives the reasons and points to the probe; made as the
    # package makes it (Registry.instance), it also names the backends that would run the call
    with pytest.raises(NotImplementedError, match=r"dtype=fp32[\s\S]*usp-hal probe"):
        backend.forward(q.float(), k.float(), v.float(), KernelCall(scale=s))
    backend.registry = usp_hal.dispatch.registry.REGISTRY
    with pytest.raises(NotImplementedError, match="alibi_slopes not supported"):
        backend.forward(q, k, v, KernelCall(scale=s, alibi_slopes=torch.ones(4)))
    with pytest.raises(NotImplementedError, match="dropout_p=0.1 not supported"):
        backend.forward(q, k, v, KernelCall(scale=s, dropout_p=0.1))
    with pytest.raises(NotImplementedError, match=r"dtype=fp32[\s\S]*sdpa"):
        backend.forward(q.float(), k.float(), v.float(), KernelCall(scale=s))
    with pytest.raises(NotImplementedError, match="window/alibi across ring blocks"):
        backend.forward(q, k, v, KernelCall(scale=s, window=(4, 0), key_offset=16))
    q2, k2, v2, _ = make_inputs(sq=12, sk=20, d=32, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="bottom-right"):
        backend.forward(q2, k2, v2, KernelCall(scale=s, causal=True))        # top-left causal, Sk > Sq
    big = make_inputs(d=224, dtype=torch.bfloat16)
    out, lse = backend.forward(*big[:3], KernelCall(scale=s))
    with pytest.raises(NotImplementedError, match="deterministic backward is not available for head_dim=224"):
        backend.backward(big[3], *big[:3], out, lse, KernelCall(scale=s, deterministic=True))
    backend.backward(big[3], *big[:3], out, lse, KernelCall(scale=s, deterministic=False))


def test_contract_fa3_declared_rules_reach_the_core():
    """contract: the declarations alone refuse ring windows, sm80 devices and deterministic hdim 256."""
    req = AttnRequest(dtype=torch.bfloat16, device_type="cuda", head_dim=128, window=(64, 0), needs_grad=True)
    assert not FlashAttn3Backend.not_supported_reasons(req)
    assert any("ring blocks" in r for r in FlashAttn3Backend.not_supported_reasons(req.with_(key_offset=True)))
    assert FlashAttn3Backend.not_supported_reasons(req.with_(compute_capability=(8, 0)))
    assert not FlashAttn3Backend.not_supported_reasons(req.with_(compute_capability=(9, 0)))
    assert FlashAttn3Backend.not_supported_reasons(req.with_(head_dim=256, deterministic=True))
    assert not FlashAttn3Backend.not_supported_reasons(req.with_(head_dim=256))
    assert FlashAttn3Backend.not_supported_reasons(req.with_(device_type="rocm"))
    # Dk != Dv (hopper/flash_api.cpp mha_fwd): (128, 192] with (96, 128], or <= 64 with V up to 256 here
    assert not FlashAttn3Backend.not_supported_reasons(req.with_(head_dim=192, head_dim_v=128))
    assert not FlashAttn3Backend.not_supported_reasons(req.with_(head_dim=64, head_dim_v=256))
    for dk, dv in ((128, 96), (96, 64), (192, 64), (64, 512)):
        why = FlashAttn3Backend.not_supported_reasons(req.with_(head_dim=dk, head_dim_v=dv))
        assert any("value head dim of its own only for" in r for r in why), (dk, dv, why)
    assert any("rounds the larger up to 256" in r for r in FlashAttn3Backend.not_supported_reasons(
        req.with_(head_dim=64, head_dim_v=256, deterministic=True)))


# --------------------------------------------------------------------------- availability
def _only_cpu(monkeypatch):
    monkeypatch.setattr(usp_hal.dispatch.platform, "available_device_types", lambda: ("cpu",))


def _cuda(monkeypatch, cc):
    monkeypatch.setattr(usp_hal.dispatch.platform, "available_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(usp_hal.dispatch.platform, "compute_capability", lambda dev, index=0: cc)


def test_contract_fa3_availability_not_installed(monkeypatch):
    """contract: without FA3, availability says so and how to get it (it is not on PyPI)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(FA3_DIST)
        pytest.skip("a real FlashAttention-3 is installed here")
    except PackageNotFoundError:
        pass
    _only_cpu(monkeypatch)
    avail = FlashAttn3Backend.availability()
    assert not avail.ok
    assert avail.reason.startswith("flash_attn_3 not installed (not on PyPI: build it from the hopper/")


def test_contract_fa3_availability_needs_cuda_and_never_imports(fa3, monkeypatch):
    """contract: installed but no cuda device -> that reason; detection imports no kernel package."""
    fa3("new", version="3.0.0b1")
    _only_cpu(monkeypatch)
    avail = FlashAttn3Backend.availability()
    assert not avail.ok and avail.version == "3.0.0b1"
    assert avail.reason == "needs a cuda device, found cpu"
    FlashAttn3Backend.not_supported_reasons(AttnRequest(dtype=torch.float16, device_type="cuda"))
    FlashAttn3Backend.capabilities()
    assert not {"flash_attn_interface", "flash_attn_3", "flash_attn_3._C"} & set(sys.modules)


def test_contract_fa3_availability_needs_sm90(fa3, monkeypatch):
    """contract: an sm80 device is refused with the documented sm90 requirement; sm90 is fine."""
    fa3("old")
    _cuda(monkeypatch, (8, 0))
    avail = FlashAttn3Backend.availability()
    assert not avail.ok and avail.reason == "needs cuda compute capability >= 9.0, found 8.0"
    _cuda(monkeypatch, (9, 0))
    avail = FlashAttn3Backend.availability()
    assert avail.ok and avail.details == {"device": "cuda"}


# --------------------------------------------------------------------------- the real builds' quirks
def test_contract_fa3_sm90_only_with_an_upper_bound(fa3):
    """The kernels are compiled for sm_90a: sm100/sm120 are refused (declared upper bound),
    where the stand-in's extension has no kernel image."""
    backend = fa3("new")
    for cc in ((10, 0), (12, 0)):
        with usp_hal.dispatch.platform.emulate("cuda", compute_capability=cc):
            avail = FlashAttn3Backend.availability()
            assert not avail.ok and f"<= 9.0 only, found {cc[0]}.{cc[1]}" in avail.reason
            q, k, v, _ = make_inputs(d=32, dtype=torch.float16)
            with pytest.raises(NotImplementedError, match="compute capability <= 9.0"):
                backend.forward(q, k, v, KernelCall(scale=0.2))
            c_ext = importlib.import_module("flash_attn_3._C")
            args = [q, k, v] + [None] * 20 + [0.25, False, -1, -1, 0, 0.0, True, None, 1, None, 0]
            with pytest.raises(RuntimeError, match="no kernel image"):
                c_ext.fwd(*args)


def test_contract_fa3_window_normalisation_is_exact_for_long_queries(fa3):
    """FA3 drops a right bound only from Sq - 1 on (exact), unlike FA2's Sk: Sq=24, Sk=12
    causal is expressible and correct."""
    backend = fa3("new")
    q, k, v, dout = make_inputs(sq=24, sk=12, d=32, dtype=torch.float16)
    _check_against_reference(backend, torch.float16, dict(sq=24, sk=12, d=32), dict(causal=True))
    req = AttnRequest(dtype=torch.float16, device_type="cuda", causal=True, seqlen_q=24, seqlen_k=12)
    assert FlashAttn3Backend.not_supported_reasons(req) == []


def test_contract_fa3_pre_2025_builds_are_not_recognised(tmp_path, monkeypatch):
    """Builds before the 2025-01-07 refactor took no softcap (and dropped right bounds from
    Sk, like FA2): their window_size=(l, r) API is refused as unrecognised, never guessed."""
    files = fa3_files("old")
    files["flash_attn_interface.py"] = (
        "def _flash_attn_forward(q, k, v, softmax_scale, causal, window_size, descale_q=None):\n"
        "    raise AssertionError('must not be called')\n\n\n"
        "def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,\n"
        "                         window_size, deterministic=False):\n"
        "    raise AssertionError('must not be called')\n")
    install_standin(tmp_path, monkeypatch, dist=FA3_DIST, version="3.0.0b1", files=files)
    try:
        q, k, v, _ = make_inputs(d=16, dtype=torch.float16)
        with pytest.raises(BackendUnavailable, match="unrecognised flash_attn_interface API"):
            FlashAttn3Backend().forward(q, k, v, KernelCall(scale=0.25))
    finally:
        purge_modules(FA3_TOP_LEVEL)


def test_contract_fa3_op_name_clash_is_unavailable_with_the_reason(tmp_path, monkeypatch):
    """FA3 builds from 2025-07-16 to 2025-08-19 register flash_attn::_flash_attn_forward, like
    flash-attn >= 2.7: availability reads both interface files (nothing imported) and says
    why; a later build (flash_attn_3::) is fine next to flash-attn."""
    install_standin(tmp_path / "fa2", monkeypatch, dist=FA2_DIST, version="2.8.3",
                    files=fa2_files("2.8.3", op_namespace="flash_attn"))
    install_standin(tmp_path / "fa3", monkeypatch, dist=FA3_DIST, version="3.0.0b1",
                    files=fa3_files("new", op_namespace="flash_attn"))
    try:
        avail = FlashAttn3Backend.availability()
        assert not avail.ok and "registers flash_attn::_flash_attn_forward" in avail.reason
        assert "flash-attn 2.8.3" in avail.reason
        assert not {"flash_attn", "flash_attn_interface", "flash_attn_3"} & set(sys.modules)
        q, k, v, _ = make_inputs(d=16, dtype=torch.float16)
        with pytest.raises(BackendUnavailable, match="registers flash_attn::_flash_attn_forward"):
            FlashAttn3Backend().forward(q, k, v, KernelCall(scale=0.25))
        assert usp_hal.dispatch.registry.REGISTRY.reasons("fa3", AttnRequest(dtype=torch.float16, device_type="cuda",
                                                                    compute_capability=(9, 0)))[0].startswith(
            "unavailable: this FlashAttention-3 build registers")
    finally:
        purge_modules(FA3_TOP_LEVEL + FA2_TOP_LEVEL)
    install_standin(tmp_path / "fa3b", monkeypatch, dist=FA3_DIST, version="3.0.0b1",
                    files=fa3_files("new", op_namespace="flash_attn_3"))
    try:
        assert FlashAttn3Backend.availability().ok
    finally:
        purge_modules(FA3_TOP_LEVEL + FA2_TOP_LEVEL)
