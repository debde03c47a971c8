"""KDA (kimi_linear's Kimi delta attention: the gated delta rule with a decay per key channel)
by state passing: usp_hal.mixers.state_passing.gated_delta_rule with ``g [B, T, H, dk]`` on 2 and 4
gloo ranks against the float64 recurrence over the whole sequence (output and every input's
gradient), with packed documents, with transformers' chunked KDA kernel in fp32; a dropped state
must fail.  The float64 per-channel recurrence is checked against transformers' kernels."""
from __future__ import annotations

import pytest
import torch

from tests import dist_kda
from usp_hal.mixers import state_passing as sp

CU = (0, 5, 13, 26)


def _within(results):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if not v <= 1.0}
        assert not bad, f"rank {rank}: worst error / tolerance above 1: {bad}"


@pytest.mark.multirank
@pytest.mark.parametrize("U,R,layout,kw", [
    (1, 2, "zigzag", {}),
    (2, 2, "basic", {}),
    (1, 4, "zigzag", {"S": 10}),                                 # pieces of 1-2 tokens chained over 4 ranks
    (2, 2, "varlen_zigzag", {"cu": CU}),                         # packed documents: zero state at each start
    (1, 2, "zigzag", {"dtype": "fp32", "kernel": "transformers"}),
], ids=["r2-zigzag", "u2r2-basic", "r4-short-pieces", "u2r2-documents", "r2-transformers-fp32"])
def test_kda_state_passing_matches_whole_sequence(pools, U, R, layout, kw):
    _within(pools(U * R).run(dist_kda.kda_case, timeout=120, U=U, R=R, layout=layout, **kw))


@pytest.mark.multirank
def test_kda_dropped_state_is_caught(pools):
    res = pools(2).run(dist_kda.kda_case, timeout=120, U=1, R=2, layout="zigzag", mutation="drop_state")
    worst = max(max(r.values()) for r in res)
    assert worst > 10, worst


def test_per_channel_reference_matches_transformers_kda():
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    g = torch.Generator().manual_seed(6)
    B, T, H, dk, dv = 1, 21, 2, 4, 6
    q, v = torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dv, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    gg, beta = -torch.rand(B, T, H, dk, generator=g), torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, dk, dv, generator=g)
    ours, st = sp.delta_rule_reference(*(t.double() for t in (q, k, v, gg, beta)), initial_state=s0.double())
    for fn, kw in ((mod.chunk_kimi_delta_attention, {"chunk_size": 8}), (mod.recurrent_kimi_delta_attention, {})):
        theirs, st2 = fn(q, k, v, gg, beta, initial_state=s0, output_final_state=True, **kw)
        torch.testing.assert_close(theirs.double(), ours, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(st2.double(), st, atol=2e-4, rtol=2e-4)
    # a scalar decay per head (the gated delta rule) is another recurrence: the test sees the difference
    scalar, _ = sp.delta_rule_reference(*(t.double() for t in (q, k, v, gg.mean(-1), beta)),
                                        initial_state=s0.double())
    assert (scalar - ours).abs().max() > 1e-2
