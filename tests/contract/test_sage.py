"""Contract tests for the SageAttention adapter (``usp_hal.backends.sage``).

They prove the *adapter*, not the kernel: a stand-in ``sageattention`` package with the
real import path and the behaviour of the real releases (1.0.6 from its wheel: no
``return_lse``, head dims 64/96/128, ``k -= km`` in place; 2.x: ``return_lse``,
architectures per version, the lse smoothing correction's GQA errors before 2.2.0)
computes exact attention on CPU tensors, and the adapter's output and lse are compared
with the float64 reference.  The stand-in is not quantised, so these tests say nothing
about Sage's accuracy; the per-device CI runs the real kernel.
"""
from __future__ import annotations

import pytest
import torch

from usp_hal import REGISTRY, AttnRequest, KernelCall, get_backend
from usp_hal.backends.sage import SageFP8Backend
from usp_hal.dispatch import backend as backend_mod
from usp_hal.dispatch import platform
from usp_hal.dispatch.reference import TOLERANCES

from .standins_misc import (
    assert_import_is_clean,
    assert_lse_matches,
    assert_matches,
    install,
    make_inputs,
    purge_modules,
    reference,
    sage_files,
)

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))

V1, V2 = "1.0.6", "2.2.0"
V2_0, V2_1_1 = "2.0.1", "2.1.1"


@pytest.fixture
def sage(tmp_path, monkeypatch):
    """Install a sageattention stand-in of the given version; returns the kernel module."""
    def _install(version):
        install(tmp_path / version, monkeypatch, "sageattention", version, sage_files(version))
        import sageattention
        return sageattention
    yield _install
    purge_modules(["sageattention"])


def cuda_request(**kw):
    kw.setdefault("dtype", torch.float16)
    kw.setdefault("device_type", "cuda")
    return AttnRequest(**kw)


def test_contract_registry_entry_is_this_class():
    assert get_backend("sage_fp8") is SageFP8Backend
    caps = SageFP8Backend.capabilities()
    assert caps["backward"] is False and "lossy" in caps["description"]
    # a quantised kernel declares the error budget the probe verifies it against
    for dtype in SageFP8Backend.SUPPORTED_DTYPES:
        assert SageFP8Backend.LOSSY_TOLERANCES[dtype] > TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,h,hkv,d,causal", [
    (1, 4, 4, 64, False),
    (2, 4, 2, 64, True),      # B > 1, GQA, causal
    (2, 6, 3, 40, False),     # odd head dim, GQA
])
def test_contract_v2_forward_matches_reference(sage, dtype, b, h, hkv, d, causal):
    kernel = sage(V2)
    q, k, v, _ = make_inputs(b, 32, 32, h, hkv, d, dtype)
    out, lse = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.21, causal=causal))
    ref_out, ref_lse = reference(q, k, v, softmax_scale=0.21, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, 32)
    assert_matches(out, ref_out, dtype, "out")
    assert_lse_matches(lse, ref_lse)
    call = kernel.CALLS[-1]
    assert call["tensor_layout"] == "NHD" and call["return_lse"] is True and call["sm_scale"] == 0.21


@pytest.mark.parametrize("version", [V1, V2])
def test_contract_causal_reaches_the_kernel(sage, version):
    """Peers drop ``causal`` on the way to Sage; here it must arrive and change the result."""
    kernel = sage(version)
    q, k, v, _ = make_inputs(1, 24, 24, 2, 2, 64, torch.float16, seed=3)
    out, _ = SageFP8Backend().forward(q, k, v, KernelCall(scale=None, causal=True))
    assert kernel.CALLS[-1]["is_causal"] is True
    causal_ref, _ = reference(q, k, v, causal=True)
    full_ref, _ = reference(q, k, v, causal=False)
    assert_matches(out, causal_ref, torch.float16, "causal out")
    assert (out.double() - full_ref).abs().max() > 0.1, "output equals non-causal attention: causal was dropped"


def test_contract_v1_pads_head_dim_and_returns_no_lse(sage):
    kernel = sage(V1)
    q, k, v, _ = make_inputs(2, 64, 64, 4, 2, 40, torch.bfloat16, seed=1)
    out, lse = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.3, causal=False))
    # v1 has no lse: the contract's stand-in for it is NaN (never merged: dispatch refuses lse calls)
    assert lse.shape == (2, 4, 64) and lse.dtype == torch.float32 and torch.isnan(lse).all()
    assert kernel.CALLS[-1]["head_dim"] == 64 and kernel.CALLS[-1]["sm_scale"] == 0.3
    ref_out, _ = reference(q, k, v, softmax_scale=0.3)
    assert out.shape == q.shape
    assert_matches(out, ref_out, torch.bfloat16, "out")


def test_contract_v1_refuses_needs_lse_with_a_reason(sage):
    sage(V1)
    reasons = SageFP8Backend.not_supported_reasons(cuda_request(needs_lse=True))
    assert len(reasons) == 1
    assert "1.0.6 has no return_lse" in reasons[0] and "ring_degree=1" in reasons[0]
    assert SageFP8Backend.not_supported_reasons(cuda_request(needs_lse=False)) == []


def test_contract_v2_allows_needs_lse(sage):
    sage(V2)
    assert SageFP8Backend.not_supported_reasons(cuda_request(needs_lse=True)) == []


def test_contract_registry_names_the_reason_for_an_explicit_choice(sage, monkeypatch):
    sage(V1)
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(platform, "compute_capability", lambda dev, index=0: (9, 0))
    with pytest.raises(NotImplementedError, match="no return_lse"):
        REGISTRY.select("sage_fp8", cuda_request(needs_lse=True))
    assert REGISTRY.select("sage_fp8", cuda_request()) is SageFP8Backend


@pytest.mark.parametrize("req,needle", [
    (dict(needs_grad=True), "forward-only"),
    (dict(window=(8, 0)), "sliding window"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "alibi"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(head_dim=256), "head_dim=256"),
    (dict(dtype=torch.float32), "dtype=fp32"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of kv_heads"),
    (dict(compute_capability=(7, 5)), "compute capability >= 8.0"),
])
def test_contract_refusal_reasons(sage, req, needle):
    sage(V2)
    reasons = SageFP8Backend.not_supported_reasons(cuda_request(**req))
    assert any(needle in r for r in reasons), reasons


def test_contract_v2_architecture_rule(sage):
    sage(V2)
    reasons = SageFP8Backend.not_supported_reasons(cuda_request(compute_capability=(10, 0)))
    assert any("no kernel for sm100" in r for r in reasons), reasons
    assert SageFP8Backend.not_supported_reasons(cuda_request(compute_capability=(8, 9))) == []


def test_contract_forward_refuses_what_sage_cannot_do(sage):
    sage(V2)
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 64, torch.float16)
    backend = SageFP8Backend()
    for kw in (dict(window=(4, -1)), dict(softcap=5.0), dict(dropout_p=0.1),
               dict(alibi_slopes=torch.ones(2))):
        with pytest.raises(NotImplementedError, match="sage_fp8"):
            backend.forward(q, k, v, KernelCall(scale=None, **kw))
    with pytest.raises(NotImplementedError, match="Sq == Sk"):
        backend.forward(q, k[:, :4], v[:, :4], KernelCall(scale=None, causal=True))
    with pytest.raises(NotImplementedError, match="forward-only"):
        backend.backward(q, q, k, v, q, torch.zeros(1, 2, 8), KernelCall(scale=None))


def test_contract_availability_not_installed(monkeypatch):
    monkeypatch.setattr(backend_mod, "installed_version", lambda pkg: None)
    avail = SageFP8Backend.availability()
    assert not avail.ok and avail.reason == "sageattention not installed (pip install 'usp-hal[sage]')"


def test_contract_availability_needs_a_cuda_device(sage, monkeypatch):
    sage(V2)
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cpu",))
    avail = SageFP8Backend.availability()
    assert not avail.ok and "needs a cuda device, found cpu" in avail.reason and avail.version == V2


def test_contract_availability_checks_the_gpu(sage, monkeypatch):
    sage(V2)
    monkeypatch.setattr(platform, "available_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(platform, "compute_capability", lambda dev, index=0: (7, 5))
    assert "compute capability >= 8.0, found 7.5" in SageFP8Backend.availability().reason
    monkeypatch.setattr(platform, "compute_capability", lambda dev, index=0: (10, 0))
    assert "no kernel for sm100" in SageFP8Backend.availability().reason
    monkeypatch.setattr(platform, "compute_capability", lambda dev, index=0: (9, 0))
    assert SageFP8Backend.availability().ok


def test_contract_import_does_not_load_sageattention(sage):
    kernel = sage(V2)
    site = kernel.__file__.rsplit("/sageattention/", 1)[0]
    purge_modules(["sageattention"])
    assert_import_is_clean(site, module="sage", name="sage_fp8", device="cuda", kernel="sageattention")


def test_contract_v1_never_modifies_the_callers_k(sage):
    """sageattention 1.0.6 subtracts K's mean from the K it is given (``k -= km``): the
    stand-in does, and the adapter hands it a copy whenever no padded copy was made."""
    kernel = sage(V1)
    q, k, v, _ = make_inputs(1, 64, 64, 2, 2, 64, torch.float16, seed=2)
    raw = k.clone()
    kernel.sageattn(q, raw, v, tensor_layout="NHD", sm_scale=0.125)
    assert not torch.equal(raw, k), "the stand-in must mutate k like the real 1.0.6"
    before = k.clone()
    out, _ = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.125))
    assert torch.equal(k, before), "the adapter let sageattention modify the caller's k"
    assert kernel.CALLS[-1]["k_ptr"] != k.data_ptr()
    ref, _ = reference(q, k, v, softmax_scale=0.125)
    assert_matches(out, ref, torch.float16, "out")


@pytest.mark.parametrize("version,cc,ok", [
    (V2_0, (8, 6), True), (V2_0, (12, 0), False), (V2_1_1, (12, 0), True), (V2, (12, 1), False),
    ("2.2.1", (12, 1), True), (V2, (10, 0), False),
])
def test_contract_v2_architectures_follow_the_release(sage, version, cc, ok):
    """Declared per version (LIMITS) and what the stand-in's sageattn() dispatches agree."""
    kernel = sage(version)
    req = cuda_request(compute_capability=cc)
    reasons = SageFP8Backend.not_supported_reasons(req)
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 64, torch.float16)
    with platform.emulate("cuda", compute_capability=cc):
        if ok:
            assert reasons == []
            kernel.sageattn(q, k, v, tensor_layout="NHD", return_lse=True)
        else:
            assert any(f"no kernel for sm{cc[0]}{cc[1]}" in r for r in reasons), reasons
            with pytest.raises(ValueError, match="Unsupported CUDA architecture"):
                kernel.sageattn(q, k, v, tensor_layout="NHD", return_lse=True)
            with pytest.raises(NotImplementedError, match=f"no kernel for sm{cc[0]}{cc[1]}"):
                SageFP8Backend().forward(q, k, v, KernelCall(scale=None))


@pytest.mark.parametrize("version", [V2_0, V2_1_1, V2])
def test_contract_v2_gqa_lse_is_exact_despite_the_smoothing_bug(sage, version):
    """Before 2.2.0 sageattn(return_lse=True) fails for 1 < Hkv < H (its smoothing correction
    ignores GQA): the adapter repeats K/V heads, which is exact."""
    kernel = sage(version)
    q, k, v, _ = make_inputs(2, 16, 16, 4, 2, 64, torch.bfloat16, seed=4)
    if version != V2:
        with pytest.raises(RuntimeError, match="must match"):
            kernel.sageattn(q, k, v, tensor_layout="NHD", return_lse=True)
    out, lse = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.2, causal=True))
    ref_out, ref_lse = reference(q, k, v, softmax_scale=0.2, causal=True)
    assert_matches(out, ref_out, torch.bfloat16, "out")
    assert_lse_matches(lse, ref_lse)
    assert kernel.CALLS[-1]["heads"] == (4, 4)


# --------------------------------------------------------------------------- key padding (Sk % 64)
@pytest.mark.parametrize("version,cc", [(V1, (9, 0)), (V2_1_1, (8, 6))])
def test_contract_non_causal_padding_is_refused_where_the_kernel_counts_it(sage, version, cc):
    """The real non-causal Triton kernel (1.0.6; the sm86 route before 2.2.0) counts the zero
    padding of the last block of 64 keys as keys: the stand-in does too, so the kernel's own
    result is wrong, and the adapter refuses the call with the reason and the alternatives."""
    kernel = sage(version)
    q, k, v, _ = make_inputs(1, 40, 40, 2, 2, 64, torch.float16, seed=4)
    ref_out, _ = reference(q, k, v, softmax_scale=0.125)
    with platform.emulate("cuda", compute_capability=cc):
        raw = kernel.sageattn(q, k.clone(), v, tensor_layout="NHD", is_causal=False, sm_scale=0.125)
        raw = raw[0] if isinstance(raw, tuple) else raw
        assert (raw.double() - ref_out).abs().max() > 0.05, "the stand-in no longer models the padding"
        with pytest.raises(NotImplementedError, match=r"zero padding of the last block of 64 keys.*Sk=40"):
            SageFP8Backend().forward(q, k, v, KernelCall(scale=0.125, causal=False))
        # causal calls and key lengths that are a multiple of 64 are served, and right
        out, _ = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.125, causal=True))
        assert_matches(out, reference(q, k, v, softmax_scale=0.125, causal=True)[0], torch.float16, "causal out")
        q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 64, torch.float16, seed=4)
        out, _ = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.125, causal=False))
        assert_matches(out, reference(q, k, v, softmax_scale=0.125)[0], torch.float16, "out at Sk=128")


@pytest.mark.parametrize("version,cc", [(V2, (8, 6)), (V2_1_1, (9, 0))])
def test_contract_non_causal_padding_is_masked_elsewhere(sage, version, cc):
    """sm86 from v2.2.0 (499828b masks the padded scores) and the CUDA kernels of sm80/89/90
    take any key length."""
    sage(version)
    q, k, v, _ = make_inputs(1, 40, 40, 2, 2, 64, torch.float16, seed=4)
    with platform.emulate("cuda", compute_capability=cc):
        out, lse = SageFP8Backend().forward(q, k, v, KernelCall(scale=0.125, causal=False))
    ref_out, ref_lse = reference(q, k, v, softmax_scale=0.125)
    assert_matches(out, ref_out, torch.float16, "out")
    assert_lse_matches(lse, ref_lse)


def test_contract_key_block_limit_needs_the_lengths():
    """Dispatch without lengths cannot tell: the limit fires only where Sk is known."""
    ctx = backend_mod.RuleContext(version=V1)
    req = cuda_request(compute_capability=(9, 0))
    assert backend_mod.declared_reasons(SageFP8Backend, req, ctx) == []
    assert backend_mod.declared_reasons(SageFP8Backend, req.with_(seqlen_q=100, seqlen_k=100), ctx)
    assert backend_mod.declared_reasons(SageFP8Backend, req.with_(seqlen_q=128, seqlen_k=128), ctx) == []
    assert backend_mod.declared_reasons(SageFP8Backend, req.with_(seqlen_q=100, seqlen_k=100, causal=True),
                                        ctx) == []
