"""Property-based: random meshes, splits, layouts, rotations, shapes, dtypes and options.
Every drawn call either equals float64 single-device attention (forward and gradients) on
every rank, or is refused with the same documented reason on every rank.  Packed calls
(random document boundaries) are compared with attention of each document alone.

CI runs the fixed, derandomised "ci" profile; ``HYPOTHESIS_PROFILE=long`` runs many more."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import dist_cases

pytestmark = pytest.mark.multirank

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("long", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# refusals the library documents for these draws (anything else is a failure)
REFUSALS = ("softcap", "cannot be exact")


@st.composite
def calls(draw):
    world = draw(st.sampled_from([2, 4, 2, 4, 3, 1]))
    sp = draw(st.sampled_from([d for d in (4, 3, 2, 1) if world % d == 0]))
    U = draw(st.sampled_from([d for d in range(1, sp + 1) if sp % d == 0]))
    R = sp // U
    H = draw(st.sampled_from([4, 6, 3, 1, 2, 5]))
    Hkv = draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (3, -1), (2, 1), (0, 4)]))
    return dict(world=world, U=U, R=R, low=draw(st.booleans()),
                layout=draw(st.sampled_from(["basic", "zigzag", "stripe"])),
                rotation=draw(st.sampled_from(["p2p", "allgather"])),
                B=draw(st.integers(1, 2)), S=draw(st.one_of(st.integers(8, 40), st.integers(1, 7))), H=H, Hkv=Hkv,
                D=draw(st.sampled_from([8, 3, 16, 1])), dtype=draw(st.sampled_from(["fp64", "fp32", "bf16"])),
                causal=causal, window=window, softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 5.0])),
                grad=draw(st.booleans()), return_lse=draw(st.booleans()), seed=draw(st.integers(0, 3)))


@given(case=calls())
def test_any_call_is_exact_or_refused_everywhere(pools, case):
    _check_case(pools, case, dist_cases.property_case)


# ---------------------------------------------------------------- packed documents (cu_seqlens)
@st.composite
def packed_calls(draw):
    """calls(), plus the per-document layout and document boundaries: any number of cuts
    in [0, S] (empty documents, length 1, shorter than the world, one spanning all)."""
    case = draw(calls())
    case["layout"] = draw(st.sampled_from(["basic", "zigzag", "stripe", "varlen_zigzag", "varlen_zigzag"]))
    S = case.pop("S")
    cuts = draw(st.lists(st.integers(0, S), max_size=6))
    case["cu_seqlens"] = (0, *sorted(cuts), S)
    return case


@settings(max_examples=max(15, settings().max_examples // 2))
@given(case=packed_calls())
def test_any_packed_call_is_exact_or_refused_everywhere(pools, case):
    from tests import dist_varlen
    _check_case(pools, case, dist_varlen.property_case)


def _check_case(pools, case, fn):
    world = case.pop("world")
    res = pools(world).run(fn, timeout=120, **case)
    kinds = {r[0] for r in res}
    assert len(kinds) == 1, f"ranks disagree: {res}"
    if kinds == {"refused"}:
        msgs = {r[1] for r in res}
        assert any(any(k in m for k in REFUSALS) for m in msgs), f"undocumented refusal for {case}: {msgs}"
        return
    for _, errs in res:
        bad = {k: v for k, v in errs.items() if not v <= 1.0}
        assert not bad, f"{case}: errors above tolerance {bad}"
