"""Hybrid models under the transformers integration on real gloo ranks: refused by name on
every rank before any data moves (see usp_hal.integrations.hybrid)."""
import pytest

pytest.importorskip("transformers")

from tests import hybrid_cases as cases  # noqa: E402

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("split", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_uncovered_hybrids_refused_on_every_rank(pools, split):
    U, R = split
    res = pools(2).run(cases.hybrid_refusals, timeout=180, U=U, R=R)
    layers = {"qwen3_next": "Qwen3NextGatedDeltaNet", "lfm2": "Lfm2ShortConv", "mamba": "MambaMixer"}
    for rank, r in enumerate(res):
        for mt, cls in layers.items():
            for case in (mt, mt + "_again", mt + "_generate"):
                assert r[case] is not None, f"rank {rank}: {case} ran"
                assert f"model type {mt!r}" in r[case] and cls in r[case], f"rank {rank}: {case}: {r[case]}"
            assert "layers.0" in r[mt], r[mt]
