"""Every accelerator adapter through ``usp_hal.LongContextAttention``, on 1 rank and on 2
gloo ranks (Ulysses-2 and, where the backend has an lse, Ring-2), forward and (where
declared) gradients, against the float64 single-process reference.

The adapter's kernel is a stand-in on the CPU (tests/contract/usp_cases.py installs it in
each rank process) and its device is emulated by ``usp_hal.dispatch.platform.emulate``: the core
runs unchanged.  These prove the adapters inside the USP core, not the kernels.  Calls a
backend cannot serve (gradients on a forward-only kernel; ring > 1 or return_lse
without an lse) must be refused by dispatch, on every rank, before any data collective.
"""
from __future__ import annotations

import pytest

from . import usp_cases

pytestmark = [pytest.mark.contract, pytest.mark.multirank]

CUDA90 = dict(device_type="cuda", compute_capability=(9, 0))
# name -> (stand-in, emulated device, attn_type, dtype, has backward, has lse, extra case kwargs)
ADAPTERS = {
    "fa2-2.8.3": ({"kind": "fa2", "arg": "2.8.3"}, CUDA90, "fa2", "bf16", True, True, dict(softcap=2.0)),
    "fa2-2.5.9": ({"kind": "fa2", "arg": "2.5.9"}, dict(device_type="cuda", compute_capability=(8, 0)), "fa2",
                  "fp16", True, True, {}),
    "fa2-triton-amd": ({"kind": "fa2-triton-amd", "arg": "2.8.3"}, dict(device_type="rocm"), "fa2", "fp16", True,
                       True, {}),
    "fa3-new": ({"kind": "fa3", "arg": "new"}, CUDA90, "fa3", "bf16", True, True, {}),
    "fa3-old": ({"kind": "fa3", "arg": "old"}, CUDA90, "fa3", "fp16", True, True, {}),
    "sage-1.0.6": ({"kind": "sage", "arg": "1.0.6"}, CUDA90, "sage_fp8", "fp16", False, False, dict(D=64)),
    "sage-2.2.0": ({"kind": "sage", "arg": "2.2.0"}, CUDA90, "sage_fp8", "bf16", False, True, {}),
    "flashinfer": ({"kind": "flashinfer", "arg": "0.6.18"}, CUDA90, "flashinfer", "fp16", False, True,
                   dict(softcap=3.0)),
    "npu": ({"kind": "npu", "arg": "2.14.0"}, dict(device_type="npu"), "npu", "fp16", True, True, {}),
    "xpu-2.13": ({"kind": "xpu"}, dict(device_type="xpu", device_model="intel_gpu_pvc", torch_version="2.13.0+xpu"),
                 "xpu", "bf16", True, True, dict(D=40)),
    "xpu-2.12": ({"kind": "xpu"}, dict(device_type="xpu", device_model="intel_gpu_bmg_g31",
                                       torch_version="2.12.0+xpu"), "xpu", "fp16", True, True, dict(D=40)),
    "sdpa-cuda": ({"kind": "sdpa-cuda"}, CUDA90, "sdpa", "bf16", True, True, dict(D=20)),
}


def _meshes(has_lse):
    return [(1, 1, 1), (2, 2, 1)] + ([(2, 1, 2)] if has_lse else [])


CASES = [(name, mesh) for name, spec in ADAPTERS.items() for mesh in _meshes(spec[5])]


def _check(errs):
    bad = {k: v for k, v in errs.items() if not v <= 1.0}
    assert not bad, f"errors above tolerance (1.0 = limit): {bad} (all: {errs})"


@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{n}-w{m[0]}-u{m[1]}r{m[2]}" for n, m in CASES])
def test_adapter_through_long_context_attention(pools, name, mesh):
    standin, emulate, attn_type, dtype, bwd, lse, extra = ADAPTERS[name]
    world, U, R = mesh
    kw = dict(D=32, H=4, Hkv=2, S=24, B=2, causal=True, layout="zigzag" if R > 1 else "basic")
    kw.update(extra)
    res = pools(world).run(usp_cases.adapter_case, timeout=120, standin=standin, emulate=emulate,
                           attn_type=attn_type, U=U, R=R, dtype=dtype, grad=bwd, return_lse=lse, **kw)
    for errs in res:
        assert set(errs) >= {"out"} | ({"dq", "dk", "dv"} if bwd else set()) | ({"lse"} if lse else set())
        _check(errs)


@pytest.mark.parametrize("mesh", [(2, 1, 2), (2, 2, 1)], ids=["ring2", "ulysses2"])
def test_sdpa_cuda_window_and_alibi_with_uneven_shards(pools, mesh):
    """Window/alibi across ring blocks with uneven shards (Sk % 8 != 0): the aligned bias."""
    world, U, R = mesh
    for extra in (dict(window=(5, 0)), dict(alibi=True)):
        res = pools(world).run(usp_cases.adapter_case, timeout=120, standin={"kind": "sdpa-cuda"}, emulate=CUDA90,
                               attn_type="sdpa", U=U, R=R, dtype="bf16", grad=True, return_lse=True, S=13, H=4,
                               D=24, causal=True, layout="basic", **extra)
        for errs in res:
            _check(errs)


# name -> (stand-in, emulate, attn_type, U, R, grad, return_lse, expected reason)
REFUSALS = {
    "sage-v1-ring": ({"kind": "sage", "arg": "1.0.6"}, CUDA90, "sage_fp8", 1, 2, False, False, "no return_lse"),
    "sage-v1-lse": ({"kind": "sage", "arg": "1.0.6"}, CUDA90, "sage_fp8", 2, 1, False, True, "no return_lse"),
    "sage-grad": ({"kind": "sage", "arg": "2.2.0"}, CUDA90, "sage_fp8", 2, 1, True, False, "forward-only"),
    "flashinfer-grad": ({"kind": "flashinfer", "arg": "0.6.18"}, CUDA90, "flashinfer", 1, 2, True, False,
                        "forward-only"),
    "fa2-sm75": ({"kind": "fa2", "arg": "2.8.3"}, dict(device_type="cuda", compute_capability=(7, 5)), "fa2", 2, 1,
                 False, False, "compute capability >= 8.0"),
    "xpu-torch-2.9": ({"kind": "xpu"}, dict(device_type="xpu", device_model="intel_gpu_pvc",
                                            torch_version="2.9.1+xpu"), "xpu", 2, 1, False, False,
                      "has no XPU flash-attention kernel"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_dispatch_refuses_before_any_collective(pools, name):
    standin, emulate, attn_type, U, R, grad, lse, needle = REFUSALS[name]
    res = pools(2).run(usp_cases.refused_before_collectives, timeout=120, standin=standin, emulate=emulate,
                       attn_type=attn_type, U=U, R=R, grad=grad, return_lse=lse)
    for r in res:
        assert r["error"] is not None and needle in r["error"], r
        assert sum(r["counts"].values()) == 0, r


def test_no_lse_backend_serves_exactly_the_calls_it_can(pools):
    """sageattention 1.0.6 (no lse, forward-only) serves Ulysses-only inference calls (non-causal ones
    with a key length that is a multiple of its 64-key blocks: see test_sage.py)."""
    res = pools(2).run(usp_cases.adapter_case, timeout=120, standin={"kind": "sage", "arg": "1.0.6"},
                       emulate=CUDA90, attn_type="sage_fp8", U=2, R=1, dtype="bf16", grad=False,
                       return_lse=False, S=64, H=4, D=96, causal=False)
    for errs in res:
        _check(errs)


@pytest.mark.parametrize("world,U", [(1, 1), (2, 2)], ids=["w1", "ulysses2"])
def test_sage_v1_non_causal_padded_keys_refused_through_the_core(pools, world, U):
    """sageattention 1.0.6's non-causal kernel counts the padding of a partial 64-key block
    as keys: a call whose gathered key length is not a multiple of 64 fails on every rank,
    naming the reason and the alternatives, instead of returning a wrong output."""
    res = pools(world).run(usp_cases.refused_before_collectives, timeout=120,
                           standin={"kind": "sage", "arg": "1.0.6"}, emulate=CUDA90, attn_type="sage_fp8", U=U,
                           R=1, S=40, H=2, D=64, causal=False)
    for r in res:
        assert r["error"] is not None and "zero padding of the last block of 64 keys" in r["error"], r
        assert "Sk=40" in r["error"] and "causal=True" in r["error"], r


def test_sage_v1_padded_keys_refused_before_any_collective(pools):
    res = pools(2).run(usp_cases.refused_before_collectives, timeout=120, standin={"kind": "sage", "arg": "1.0.6"},
                       emulate=CUDA90, attn_type="sage_fp8", U=2, R=1, S=40, H=2, D=64, causal=False)
    for r in res:
        assert r["error"] is not None and "Sk=40" in r["error"], r
        assert sum(r["counts"].values()) == 0, r
