"""Every declared capability fact produces the right reason (and only then)."""
from __future__ import annotations

import pytest
import torch

from tests.contract.standin import install_standin, purge_modules
from usp_hal.dispatch import platform
from usp_hal.dispatch.backend import AttentionBackend, installed_version, parse_version
from usp_hal.dispatch.capabilities import (
    AttnRequest,
    Package,
    capability_row,
    dtype_name,
    not_supported_reasons,
    parse_dtype,
)


class Minimal(AttentionBackend):
    """Declares little: cpu, fp32, causal only (base defaults for the rest)."""
    NAME = "minimal"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})
    SUPPORTS_GQA = False
    RETURNS_LSE = False
    HAS_BACKWARD = False


class Rich(AttentionBackend):
    """Declares everything on."""
    NAME = "rich"
    SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
    HEAD_DIM_MIN = 16
    HEAD_DIM_MAX = 256
    HEAD_DIM_MULTIPLE = 8
    SUPPORTS_DIFFERENT_V_DIM = True
    SUPPORTS_WINDOW = True
    SUPPORTS_SOFTCAP = True
    SUPPORTS_ALIBI = True
    SUPPORTS_DROPOUT = True
    SUPPORTS_KEY_OFFSET = True
    SUPPORTS_DETERMINISTIC = True
    MIN_COMPUTE_CAPABILITY = {"cuda": (8, 0)}


OK = AttnRequest(dtype=torch.float32, device_type="cpu", head_dim=64, num_heads=4)


def reasons(cls, **change):
    return not_supported_reasons(cls, OK.with_(**change))


def one_reason(cls, **change) -> str:
    got = reasons(cls, **change)
    assert len(got) == 1, got
    return got[0]


def test_plain_request_is_supported_by_both():
    assert reasons(Minimal) == [] and reasons(Rich) == []
    assert Minimal.supports(OK) and Rich.supports(OK)
    assert Minimal.not_supported_reasons(OK) == []


def test_device():
    r = one_reason(Minimal, device_type="cuda")
    assert r == "device=cuda (supported: cpu)"
    assert "device=npu (supported: cpu, cuda)" == one_reason(Rich, device_type="npu")


def test_dtype():
    assert one_reason(Minimal, dtype=torch.float16) == "dtype=fp16 (supported: fp32)"
    assert one_reason(Rich, dtype=torch.float64) == "dtype=fp64 (supported: fp32, bf16, fp16)"


@pytest.mark.parametrize("hd, expect", [
    (8, "head_dim=8 (supported: 16..256)"),
    (264, "head_dim=264 (supported: 16..256)"),
    (60, "head_dim=60 is not a multiple of 8"),
    (16, None), (256, None), (72, None),
])
def test_head_dim_range_and_multiple(hd, expect):
    got = reasons(Rich, head_dim=hd)
    assert got == ([] if expect is None else [expect])


def test_head_dim_unbounded_above_by_default():
    assert reasons(Minimal, head_dim=1000) == []
    assert reasons(Minimal, head_dim=0) == ["head_dim=0 (supported: 1..any)"]


def test_different_v_dim():
    assert one_reason(Minimal, head_dim_v=32) == "value head_dim 32 differs from query head_dim 64"
    assert reasons(Rich, head_dim_v=32) == []
    assert reasons(Minimal, head_dim_v=64) == []            # equal is not "different"


def test_gqa_and_mqa():
    assert "GQA/MQA (heads=4, kv_heads=2) not supported" == one_reason(Minimal, num_kv_heads=2)
    assert "GQA/MQA (heads=4, kv_heads=1) not supported" == one_reason(Minimal, num_kv_heads=1)
    assert reasons(Minimal, num_kv_heads=4) == []
    assert reasons(Rich, num_kv_heads=2) == [] and reasons(Rich, num_kv_heads=1) == []


def test_gqa_heads_not_a_multiple():
    assert one_reason(Rich, num_heads=6, num_kv_heads=4) == "heads=6 is not a multiple of kv_heads=4"
    assert one_reason(Rich, num_kv_heads=0) == "heads=4 is not a multiple of kv_heads=0"


def test_causal():
    class NoCausal(Minimal):
        SUPPORTS_CAUSAL = False
    assert one_reason(NoCausal, causal=True) == "causal masking not supported"
    assert reasons(Minimal, causal=True) == []


def test_window():
    assert one_reason(Minimal, window=(4, 0)) == "sliding window (4, 0) not supported"
    assert one_reason(Minimal, window=(-1, 3)) == "sliding window (-1, 3) not supported"
    assert reasons(Minimal, window=(-1, -1)) == []
    assert reasons(Rich, window=(4, 0)) == []


def test_softcap_alibi_dropout():
    assert one_reason(Minimal, softcap=30.0) == "softcap=30.0 not supported"
    assert one_reason(Minimal, alibi=True) == "alibi_slopes not supported"
    assert one_reason(Minimal, dropout_p=0.1) == "dropout_p=0.1 not supported"
    assert reasons(Rich, softcap=30.0, alibi=True, dropout_p=0.1) == []


def test_key_offset_only_matters_with_window_or_alibi():
    class NoOffset(Rich):
        SUPPORTS_KEY_OFFSET = False
    assert reasons(NoOffset, key_offset=True) == []                       # plain ring block
    for change in (dict(window=(4, 0)), dict(alibi=True)):
        r = one_reason(NoOffset, key_offset=True, **change)
        assert "window/alibi across ring blocks" in r and "ring_degree=1" in r
        assert reasons(NoOffset, **change) == []                          # diagonal block is fine
        assert reasons(Rich, key_offset=True, **change) == []


def test_needs_lse():
    r = one_reason(Minimal, needs_lse=True)
    assert "does not return a log-sum-exp" in r and "ring degree > 1" in r
    assert reasons(Rich, needs_lse=True) == []


def test_needs_grad():
    assert one_reason(Minimal, needs_grad=True) == "forward-only kernel: no backward"
    assert reasons(Rich, needs_grad=True) == []


def test_deterministic():
    class Nondet(Rich):
        SUPPORTS_DETERMINISTIC = False

    class AlwaysDet(Nondet):
        IS_DETERMINISTIC = True
    assert one_reason(Nondet, deterministic=True, needs_grad=True) == "backward is not deterministic"
    assert reasons(Nondet, deterministic=True) == []                      # forward only: nothing to fix
    assert reasons(Rich, deterministic=True, needs_grad=True) == []       # on request
    assert reasons(AlwaysDet, deterministic=True, needs_grad=True) == []


def test_compute_capability():
    cuda = dict(device_type="cuda")
    assert one_reason(Rich, compute_capability=(7, 5), **cuda) == "needs compute capability >= 8.0, found 7.5"
    assert reasons(Rich, compute_capability=(8, 0), **cuda) == []
    assert reasons(Rich, compute_capability=(9, 0), **cuda) == []
    assert reasons(Rich, compute_capability=None, **cuda) == []            # unknown: not refused here
    assert reasons(Rich, compute_capability=(7, 5)) == []                  # cpu has no minimum


def test_all_reasons_are_listed_not_just_the_first():
    got = reasons(Minimal, device_type="cuda", dtype=torch.float16, num_kv_heads=1, window=(2, 2),
                  softcap=5.0, needs_lse=True, needs_grad=True)
    assert len(got) == 7, got


def test_extra_reasons_hook_extends_the_declared_rules():
    class Picky(Rich):
        @classmethod
        def extra_reasons(cls, req):
            return ["bf16 only on cuda"] if req.dtype == torch.bfloat16 and req.device_type == "cpu" else []
    assert reasons(Picky, dtype=torch.bfloat16) == ["bf16 only on cuda"]
    assert reasons(Picky, dtype=torch.bfloat16, device_type="cuda") == []
    assert reasons(Picky, dtype=torch.float64) == ["dtype=fp64 (supported: fp32, bf16, fp16)"]


def test_request_helpers():
    r = OK.with_(num_kv_heads=None, head_dim_v=None)
    assert r.kv_heads == 4 and r.v_dim == 64 and not r.has_window
    text = OK.with_(window=(3, 0), softcap=2.0, alibi=True, deterministic=True).describe()
    for part in ("dtype=fp32", "device=cpu", "heads=4/4", "window=(3, 0)", "softcap=2.0", "alibi", "deterministic"):
        assert part in text
    assert dtype_name(torch.bfloat16) == "bf16"
    assert parse_dtype("float16") is torch.float16 and parse_dtype("BF16") is torch.bfloat16
    assert parse_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        parse_dtype("fp8")


def test_capability_row_reads_the_declarations():
    row = capability_row(Rich)
    assert row["name"] == "rich"
    assert row["devices"] == ["cpu", "cuda"]
    assert row["dtypes"] == ["fp32", "bf16", "fp16"]                     # stable order
    assert row["head_dim"] == [16, 256] and row["head_dim_multiple"] == 8
    assert (row["backward"], row["lse"], row["ring"], row["window"], row["softcap"]) == (True,) * 5
    assert row["deterministic"] is True and row["key_offset"] is True
    assert row["min_compute_capability"] == {"cuda": [8, 0]}
    assert row["comm"] == ["gloo", "nccl"]
    m = capability_row(Minimal)
    assert (m["backward"], m["lse"], m["gqa"], m["window"]) == (False, False, False, False)
    assert Rich.capabilities() == row


# ----------------------------------------------------------------------------- availability
class NeedsKernel(Minimal):
    NAME = "needskernel"
    REQUIRED_PACKAGES = (Package("usp-hal-test-kernel", "usp_hal_test_kernel", min_version="2.1", extra="tk"),)


@pytest.fixture
def kernel_pkg(tmp_path, monkeypatch):
    def install(version):
        install_standin(tmp_path / version, monkeypatch, dist="usp-hal-test-kernel", version=version,
                        files={"usp_hal_test_kernel/__init__.py": "X = 1\n"})
    yield install
    purge_modules(["usp_hal_test_kernel"])


def test_availability_missing_package_names_the_extra():
    avail = NeedsKernel.availability()
    assert not avail.ok
    assert avail.reason == "usp-hal-test-kernel not installed (pip install 'usp-hal[tk]')"


def test_availability_too_old_is_compared_numerically(kernel_pkg):
    kernel_pkg("2.0.9")
    avail = NeedsKernel.availability()
    assert not avail.ok and avail.reason == "usp-hal-test-kernel 2.0.9 too old (needs >= 2.1)"
    assert avail.version == "2.0.9"


def test_availability_new_enough(kernel_pkg):
    kernel_pkg("2.10.0")                      # "2.10.0" < "2.1" as strings; not as versions
    assert installed_version(NeedsKernel.REQUIRED_PACKAGES[0]) == "2.10.0"
    avail = NeedsKernel.availability()
    assert avail.ok, avail.reason
    assert avail.version == "2.10.0" and avail.details["device"] == "cpu"


def test_availability_needs_a_declared_device():
    class CudaOnly(Minimal):
        SUPPORTED_DEVICES = frozenset({"cuda"})
    if "cuda" in platform.available_device_types():
        pytest.skip("this machine has a CUDA device")
    avail = CudaOnly.availability()
    assert not avail.ok and avail.reason.startswith("needs a cuda device, found ")


def test_extra_availability_hook():
    class Refuses(Minimal):
        @classmethod
        def extra_availability(cls, device_type, version):
            return f"driver too old on {device_type}"
    avail = Refuses.availability()
    assert not avail.ok and avail.reason == "driver too old on cpu"


def test_parse_version_handles_local_builds():
    assert parse_version("2.7.4.post1+cu12torch2.6") > parse_version("2.6.3")
    assert parse_version("2.10.0") > parse_version("2.9.9")


# ----------------------------------------------------------------------------- declared limits
from usp_hal import KernelCall  # noqa: E402
from usp_hal.dispatch.capabilities import Limit, Positions, RuleContext, Unsupported, declared_reasons, kernel_window  # noqa: E402

_CTX = RuleContext(version="2.5.0", torch_version="2.12.0")


def _fires(limit, ctx=_CTX, **change):
    return limit.fires(OK.with_(**change), ctx)


def test_limit_conditions_all_have_to_hold():
    lim = Limit("no softcap on rocm below 3", uses=("softcap",), devices=("rocm",), version="<3")
    assert _fires(lim, device_type="rocm", softcap=2.0) == "no softcap on rocm below 3"
    assert _fires(lim, device_type="cuda", softcap=2.0) is None                  # other device
    assert _fires(lim, device_type="rocm") is None                               # feature not used
    assert _fires(lim, RuleContext(version="3.1"), device_type="rocm", softcap=2.0) is None   # newer version
    assert _fires(lim, RuleContext(version=None), device_type="rocm", softcap=2.0) is None    # unknown version


def test_limit_allowed_architectures_models_head_dims_env_and_unless(monkeypatch):
    arch = Limit("{cc} not built", archs=("sm8x", "sm90"))
    assert _fires(arch, compute_capability=(10, 0)) == "sm100 not built"
    assert _fires(arch, compute_capability=(8, 6)) is None and _fires(arch, compute_capability=(9, 0)) is None
    assert _fires(arch) is None                                                  # unknown capability
    plus = Limit("old gpu", archs=("sm80+",))
    assert _fires(plus, compute_capability=(7, 5)) == "old gpu" and _fires(plus, compute_capability=(12, 0)) is None
    model = Limit("model {model}", models=("a", "b"))
    assert _fires(model, device_model="c") == "model c" and _fires(model, device_model="a") is None
    assert _fires(model) is None
    hd = Limit("hd {head_dim}", head_dims=(193, 224), pad_to=8)
    assert _fires(hd, head_dim=190) is None          # rounds up to 192
    assert _fires(hd, head_dim=193) == "hd 193" and _fires(hd, head_dim=225) is None
    env = Limit("env", env=("USP_HAL_TEST_FLAG", "TRUE"))
    monkeypatch.delenv("USP_HAL_TEST_FLAG", raising=False)
    assert _fires(env) is None
    monkeypatch.setenv("USP_HAL_TEST_FLAG", "TRUE")
    assert _fires(env) == "env"
    unless = Limit("right bound", uses=("right_window",), unless=("causal",))
    assert _fires(unless, window=(4, 2)) == "right bound" and _fires(unless, window=(4, 2), causal=True) is None
    tv = Limit("torch {torch}", torch="<2.13")
    assert _fires(tv) == "torch 2.12.0" and _fires(tv, RuleContext(torch_version="2.13.0+xpu")) is None
    with pytest.raises(ValueError, match="unknown feature 'sofcap'"):
        Limit("typo", uses=("sofcap",))
    assert "with softcap" in Limit("x", uses=("softcap",)).condition()


def test_limits_reach_not_supported_reasons_and_subclasses_extend_it_with_super():
    class Versioned(Rich):
        LIMITS = (Limit("no softcap before 2", uses=("softcap",), version="<2"),)

        @classmethod
        def kernel_version(cls):
            return "1.5"

        @classmethod
        def not_supported_reasons(cls, request):
            return super().not_supported_reasons(request) + (["odd heads"] if request.num_heads % 2 else [])

    assert Versioned.not_supported_reasons(OK.with_(softcap=1.0)) == ["no softcap before 2"]
    assert Versioned.not_supported_reasons(OK.with_(num_heads=3)) == ["odd heads"]
    assert Versioned.not_supported_reasons(OK) == []


def test_max_compute_capability():
    class Hopper(Rich):
        MAX_COMPUTE_CAPABILITY = {"cuda": (9, 0)}
    cuda = dict(device_type="cuda")
    assert reasons(Hopper, compute_capability=(9, 0), **cuda) == []
    assert one_reason(Hopper, compute_capability=(10, 0), **cuda) == \
        "built for compute capability <= 9.0 only, found 10.0"


# ----------------------------------------------------------------------------- positions
BR = Positions(alignment="bottom-right")
FA2_LIKE = Positions(alignment="bottom-right", right_unbounded_from="seqlen_k", alibi_any_lengths=False)


def _kept(sq, sk, causal, left, right):
    """Keys the bottom-right kernel keeps (after FA2's own normalisation), as a bool matrix."""
    if causal:
        right = 0
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    m = torch.arange(sq).view(-1, 1) + (sk - sq)
    n = torch.arange(sk).view(1, -1)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= n >= m - left
    if right >= 0:
        keep &= n <= m + right
    return keep


def _contract(sq, sk, causal, left, right):
    m, n = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= n <= m
    if left >= 0:
        keep &= n >= m - left
    if right >= 0:
        keep &= n <= m + right
    return keep


@pytest.mark.parametrize("sq,sk", [(12, 12), (20, 12), (12, 20), (24, 12), (13, 12), (5, 9), (30, 7)])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (3, 2)), (True, (4, -1)), (False, (-1, 0)),
                                           (False, (6, -1)), (False, (-1, 5)), (True, (2, 3))])
def test_kernel_window_is_exact_or_refused(sq, sk, causal, window):
    """Brute force: whenever kernel_window answers, a bottom-right kernel with FA2's own
    normalisation keeps exactly the contract's keys; when it refuses, it could not."""
    try:
        k_causal, left, right = kernel_window(FA2_LIKE, sq, sk, causal, window)
    except Unsupported:
        expressible = any(torch.equal(_kept(sq, sk, False, lft, rgt), _contract(sq, sk, causal, *window))
                          for lft in range(-1, sq + sk) for rgt in range(-1, sq + sk))
        assert not expressible or sq >= sk + 2, (sq, sk, causal, window)
        return
    assert torch.equal(_kept(sq, sk, k_causal, left, right), _contract(sq, sk, causal, *window)), \
        (sq, sk, causal, window, (k_causal, left, right))


def test_kernel_window_refusals_name_the_reason():
    with pytest.raises(Unsupported, match="treats as unbounded"):
        kernel_window(FA2_LIKE, 24, 12, True, (-1, -1))
    assert kernel_window(BR, 24, 12, True, (-1, -1)) == (False, -1, 12)        # exact where Sq - 1 is the rule
    with pytest.raises(Unsupported, match="negative bound"):
        kernel_window(BR, 12, 20, True, (-1, -1))
    with pytest.raises(Unsupported, match="alibi"):
        kernel_window(FA2_LIKE, 12, 20, False, (-1, -1), alibi=True)
    with pytest.raises(Unsupported, match="Sq == Sk"):
        kernel_window(Positions(causal_any_lengths=False), 12, 20, True, (-1, -1))
    assert kernel_window(Positions(), 12, 20, True, (3, -1)) == (True, 3, -1)   # top-left: as it is


def test_lengths_in_the_request_let_dispatch_apply_positions():
    class Bottom(Rich):
        POSITIONS = FA2_LIKE
    req = OK.with_(causal=True, seqlen_q=24, seqlen_k=12)
    assert any("treats as unbounded" in r for r in declared_reasons(Bottom, req))
    assert declared_reasons(Bottom, req.with_(seqlen_q=12)) == []
    assert declared_reasons(Bottom, req.with_(seqlen_q=None, seqlen_k=None)) == []


def test_capabilities_module_does_not_import_the_backend_module():
    import ast

    import usp_hal.dispatch.capabilities as caps
    tree = ast.parse(open(caps.__file__).read())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.endswith("backend") or ".backend" in m}, imported


# ----------------------------------------------------------------------------- per-call admission
class Counting(AttentionBackend):
    NAME = "counting"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})
    SUPPORTS_WINDOW = True
    POSITIONS = FA2_LIKE
    asked = 0

    @classmethod
    def not_supported_reasons(cls, request):
        cls.asked += 1
        return super().not_supported_reasons(request)

    def kernel_forward(self, q, k, v, call):
        return q.clone(), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


def test_each_call_signature_is_validated_once_and_refusals_come_before_the_kernel():
    b = Counting()
    Counting.asked = 0
    q = torch.randn(1, 8, 2, 4)
    for _ in range(5):
        b.forward(q, q, q, KernelCall(scale=0.5, causal=True))
    assert Counting.asked == 1
    b.forward(q, q, q, KernelCall(scale=0.5, window=(2, 0)))
    assert Counting.asked == 2
    with pytest.raises(NotImplementedError, match="dtype=fp64"):
        b.forward(q.double(), q.double(), q.double(), KernelCall(scale=0.5))
    with pytest.raises(NotImplementedError, match="treats as unbounded"):    # lengths: checked on every call
        b.forward(torch.randn(1, 24, 2, 4), torch.randn(1, 12, 2, 4), torch.randn(1, 12, 2, 4),
                  KernelCall(scale=0.5, causal=True))
    with pytest.raises(NotImplementedError, match="forward-only"):
        b.backward(q, q, q, q, q, torch.zeros(1, 2, 8), KernelCall(scale=0.5))


def test_kernel_call_is_one_frozen_value_and_the_request_is_built_from_it():
    """A KernelCall normalises its window, derives variants with with_(), keys admission by
    what the rules see (not the scale, not the tensors' values), and AttnRequest.of builds the
    request from the tensors and the call (fields a caller knows better given as overrides)."""
    import dataclasses

    call = KernelCall(scale=0.5, causal=True, window=[3, 0], softcap=2.0, needs_lse=True)
    assert call.window == (3, 0) and call.has_window and call.positional
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.causal = False       # type: ignore[misc]
    block = call.with_(causal=False, key_offset=7)
    assert (block.causal, block.key_offset, block.softcap, block.scale) == (False, 7, 2.0, 0.5) and call.causal
    assert KernelCall(scale=0.1, causal=True).key == KernelCall(scale=0.9, causal=True).key
    assert KernelCall(key_offset=3).key != KernelCall().key and KernelCall(needs_lse=True).key != KernelCall().key
    slopes = torch.rand(4)
    assert KernelCall(alibi_slopes=slopes).key == KernelCall(alibi_slopes=slopes * 2).key != KernelCall().key
    assert KernelCall().scale_for(16) == 0.25 and call.scale_for(16) == 0.5
    q, k, v = torch.zeros(2, 5, 4, 8), torch.zeros(2, 9, 2, 8), torch.zeros(2, 9, 2, 6)
    req = AttnRequest.of(q, k, v, call)
    assert (req.dtype, req.device_type, req.head_dim, req.head_dim_v, req.num_heads, req.kv_heads) == \
        (torch.float32, "cpu", 8, 6, 4, 2)
    assert (req.seqlen_q, req.seqlen_k, req.causal, req.window, req.softcap, req.needs_lse, req.key_offset) == \
        (5, 9, True, (3, 0), 2.0, True, False)
    over = AttnRequest.of(q, k, v, call, lengths=False, num_heads=2, key_offset=True, mask=True)
    assert (over.seqlen_q, over.num_heads, over.key_offset, over.mask) == (None, 2, True, True)
