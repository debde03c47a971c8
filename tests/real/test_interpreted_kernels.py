"""Real kernels on the CPU: SageAttention 1.0.6 and flash-attn's Triton AMD build, run by the
Triton interpreter (``TRITON_INTERPRET=1``) through the adapters and through
``LongContextAttention`` (1 rank, Ulysses-2, Ring-2 where the kernel has an lse), forward and,
where the kernel has one, backward, against float64 attention with the adapters' declared
tolerances.

What this proves: the real packages' Python API and the kernels' arithmetic as the adapters
and the USP core drive them.  What it does not: GPU races, tensor-core rounding, or what a
masked load returns on the hardware (the interpreter gives zeros).  flash-attn runs fp16 only
(the interpreter computes a bf16 ``tl.dot`` on the raw storage).  Each test is skipped, with
the reason, where triton or the package is missing (see ``.ci/run`` for the installs).
"""
from __future__ import annotations

import pytest

from usp_hal.backends import interpret

from . import cases

pytestmark = [pytest.mark.real_kernel, pytest.mark.multirank]

MISSING = {name: interpret.missing(name) for name in ("sage_fp8", "fa2")}
TIMEOUT = 240.0       # per case, every rank


def _need(name):
    if MISSING[name]:
        pytest.skip(f"{name} under the Triton interpreter: {MISSING[name]}")


def _run(interpreted, world, fn, **kw) -> list:
    res = interpreted(world).run(fn, timeout=TIMEOUT, **kw)
    assert len(res) == world
    return res


def _passes(res, want):
    for r in res:
        assert "error" not in r, r.get("error")
        assert set(r["errors"]) == set(want), r
        bad = {k: v for k, v in r["errors"].items() if not v <= 1.0}
        assert not bad, f"above the declared tolerance (1.0 = limit): {bad} (all: {r['errors']})"


# ----------------------------------------------------------------------------- SageAttention 1.0.6
SAGE_ADAPTER = {
    # id: case kwargs (forward only: Sage has no backward)
    "fp16-s64": dict(dtype="fp16", Sq=64, H=2, D=64),
    "bf16-s64": dict(dtype="bf16", Sq=64, H=2, D=64),
    "fp16-s100-causal-gqa-d40": dict(dtype="fp16", B=2, Sq=100, H=4, Hkv=2, D=40, causal=True),
    "bf16-s128-mqa-d96": dict(dtype="bf16", Sq=128, H=2, Hkv=1, D=96),
    "fp16-s65-causal-d128": dict(dtype="fp16", Sq=65, H=2, D=128, causal=True),
    "fp16-s192-gqa-b2": dict(dtype="fp16", B=2, Sq=192, H=4, Hkv=2, D=64),
    "bf16-s16-causal": dict(dtype="bf16", Sq=16, H=2, D=64, causal=True),
    "fp16-s256-scale": dict(dtype="fp16", Sq=256, H=2, D=64, scale=0.2),
}


@pytest.mark.parametrize("case", list(SAGE_ADAPTER))
def test_real_sage_adapter_matches_float64(interpreted, case):
    _need("sage_fp8")
    _passes(_run(interpreted, 1, cases.adapter_case, name="sage_fp8", **SAGE_ADAPTER[case]), {"out"})


@pytest.mark.parametrize("S", [16, 65, 100])
def test_real_sage_non_causal_padded_keys_are_wrong_and_refused(interpreted, S):
    """The real kernel counts the padding of the last 64-key block (its error is far outside the
    declared budget), and the adapter refuses exactly those calls, naming why."""
    _need("sage_fp8")
    raw = _run(interpreted, 1, cases.raw_sage_case, S=S)[0]
    assert raw["worst"] > 1.0 and raw["rms_rel"] > 0.1, raw
    res = _run(interpreted, 1, cases.adapter_case, name="sage_fp8", dtype="fp16", Sq=S, H=2, D=64)[0]
    assert "zero padding of the last block of 64 keys" in res.get("error", ""), res
    assert f"Sk={S}" in res["error"] and "causal=True" in res["error"], res


def test_real_sage_causal_and_whole_blocks_are_right_in_the_raw_kernel(interpreted):
    """The limit is no wider than the flaw: causal calls with a partial block, and non-causal
    calls on whole 64-key blocks, are within the budget in the kernel itself."""
    _need("sage_fp8")
    for kw in (dict(S=100, causal=True), dict(S=128, causal=False)):
        raw = _run(interpreted, 1, cases.raw_sage_case, **kw)[0]
        assert raw["worst"] <= 1.0, (kw, raw)


SAGE_USP = {
    "w1-s128": (1, dict(U=1, S=128, H=4, Hkv=2, D=64)),
    "w1-s100-causal": (1, dict(U=1, S=100, H=2, D=96, causal=True)),
    "ulysses2-s128-gqa": (2, dict(U=2, S=128, H=4, Hkv=2, D=64)),
    "ulysses2-s100-causal-bf16": (2, dict(U=2, S=100, H=4, D=64, causal=True, dtype="bf16")),
}


@pytest.mark.parametrize("case", list(SAGE_USP))
def test_real_sage_through_long_context_attention(interpreted, case):
    _need("sage_fp8")
    world, kw = SAGE_USP[case]
    kw = {"dtype": "fp16", **kw}
    _passes(_run(interpreted, world, cases.usp_case, name="sage_fp8", **kw), {"out"})


@pytest.mark.parametrize("world,U", [(1, 1), (2, 2)], ids=["w1", "ulysses2"])
def test_real_sage_padded_keys_refused_through_long_context_attention(interpreted, world, U):
    _need("sage_fp8")
    for r in _run(interpreted, world, cases.usp_case, name="sage_fp8", dtype="fp16", U=U, S=100, H=4, D=64):
        assert "zero padding of the last block of 64 keys" in r.get("error", ""), r


def test_real_sage_ring_refused(interpreted):
    """1.0.6 returns no lse: Ring-2 is refused on every rank, not merged from a NaN lse."""
    _need("sage_fp8")
    for r in _run(interpreted, 2, cases.usp_case, name="sage_fp8", dtype="fp16", R=2, S=128, H=2, D=64):
        assert "no return_lse" in r.get("error", ""), r


# ----------------------------------------------------------------------------- flash-attn Triton AMD
FA2_ADAPTER = {
    "s64": dict(Sq=64, H=2, D=64),
    "s100-causal-gqa-d40-b2": dict(B=2, Sq=100, H=4, Hkv=2, D=40, causal=True),
    "rect-37x80-d96": dict(Sq=37, Sk=80, H=2, Hkv=1, D=96),
    "s128-causal-mqa-d128": dict(Sq=128, H=4, Hkv=1, D=128, causal=True),
    "s16": dict(Sq=16, H=2, D=64),
    "s65-causal-scale": dict(Sq=65, H=2, D=64, causal=True, scale=0.2),
    "alibi": dict(Sq=48, H=2, D=32, alibi=True),
    "alibi-causal": dict(Sq=48, H=2, D=32, alibi=True, causal=True),
    "deterministic": dict(Sq=40, H=2, D=64, causal=True, deterministic=True),
}


@pytest.mark.parametrize("case", list(FA2_ADAPTER))
def test_real_fa2_triton_amd_adapter_matches_float64(interpreted, case):
    _need("fa2")
    _passes(_run(interpreted, 1, cases.adapter_case, name="fa2", dtype="fp16", grad=True, **FA2_ADAPTER[case]),
            {"out", "lse", "dq", "dk", "dv"})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_real_fa2_triton_amd_packed_documents(interpreted, causal):
    _need("fa2")
    _passes(_run(interpreted, 1, cases.packed_case, causal=causal), {"out", "lse", "dq", "dk", "dv"})


FA2_REFUSED = {
    # the Triton AMD kernels take a window and ignore it; the contract's top-left causal with
    # Sq > Sk becomes a bottom-right window for the kernel: refused too
    "rect-causal-20x12": (dict(Sq=20, Sk=12, causal=True), "backend takes and ignores"),
    "rect-causal-12x20": (dict(Sq=12, Sk=20, causal=True), "backend takes and ignores"),
}


@pytest.mark.parametrize("case", list(FA2_REFUSED))
def test_real_fa2_triton_amd_refuses_what_it_ignores(interpreted, case):
    _need("fa2")
    kw, needle = FA2_REFUSED[case]
    res = _run(interpreted, 1, cases.adapter_case, name="fa2", dtype="fp16", H=2, D=32, **kw)[0]
    assert needle in res.get("error", ""), res


FA2_USP = {
    "w1-causal": (1, dict(U=1, S=64, causal=True)),
    "w1-gqa": (1, dict(U=1, S=48, Hkv=2)),
    "ulysses2-causal-gqa": (2, dict(U=2, S=64, Hkv=2, causal=True)),
    "ulysses2-full": (2, dict(U=2, S=48)),
    "ring2-causal-zigzag": (2, dict(R=2, S=64, causal=True, layout="zigzag")),
    "ring2-full-basic": (2, dict(R=2, S=48, layout="basic")),
    "ring2-causal-basic-gqa": (2, dict(R=2, S=48, Hkv=2, causal=True, layout="basic")),
}


@pytest.mark.parametrize("case", list(FA2_USP))
def test_real_fa2_triton_amd_through_long_context_attention(interpreted, case):
    _need("fa2")
    world, kw = FA2_USP[case]
    kw = {"dtype": "fp16", "H": 4, "D": 32, "grad": True, "return_lse": True, **kw}
    _passes(_run(interpreted, world, cases.usp_case, name="fa2", **kw), {"out", "lse", "dq", "dk", "dv"})
