"""State passing for recurrences (usp_hal.mixers.state_passing): on 2 and 4 gloo ranks, every split,
basic and zigzag shards, packed documents, against float64 references of the whole sequence,
output and every gradient; the plain kernels against each other; and mutants (a dropped
state, an ignored document boundary) that must fail."""
from __future__ import annotations

import pytest
import torch

from tests import dist_state_passing as dsp
from usp_hal.mixers import state_passing as sp

pytestmark = pytest.mark.multirank

SPLITS = [(1, 2), (2, 1), (2, 2), (1, 4)]
CU = (0, 5, 13, 26)


def _run(pools, timeout=120, **kw):
    U, R = kw.get("U", 1), kw.get("R", 2)
    return pools(U * R).run(dsp.case, timeout=timeout, **kw)


def _assert_all_within(results):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if not v <= 1.0}
        assert not bad, f"rank {rank}: worst error / tolerance above 1: {bad}"


@pytest.mark.parametrize("op", ["gdn", "ssd"])
@pytest.mark.parametrize("U,R", SPLITS)
@pytest.mark.parametrize("layout", ["basic", "zigzag"])
def test_matches_whole_sequence_float64(pools, op, U, R, layout):
    _assert_all_within(_run(pools, op=op, U=U, R=R, layout=layout))


@pytest.mark.parametrize("op", ["gdn", "ssd"])
@pytest.mark.parametrize("layout", ["basic", "zigzag", "varlen_zigzag"])
def test_packed_documents_reset_state(pools, op, layout):
    _assert_all_within(_run(pools, op=op, U=2, R=2, layout=layout, cu=CU))


def test_short_pieces_on_four_ranks(pools):
    # 4 ranks, zigzag, S=10: pieces of 1-2 tokens (the states chain through every rank)
    _assert_all_within(_run(pools, op="gdn", U=1, R=4, layout="zigzag", S=10))


def test_transformers_gdn_kernel_in_fp32(pools):
    """transformers' own chunked gated-delta-rule kernel (fp32 inside) as the kernel."""
    pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    _assert_all_within(_run(pools, op="gdn", U=2, R=2, layout="zigzag", dtype="fp32", kernel="transformers"))


def test_chunked_ssd_kernel(pools):
    _assert_all_within(_run(pools, op="ssd", U=1, R=2, layout="zigzag", kernel="chunked"))


@pytest.mark.parametrize("op,mutation,kw", [
    ("gdn", "drop_state", {}),
    ("ssd", "drop_state", {}),
    ("gdn", "ignore_documents", {"cu": CU}),
    ("ssd", "ignore_documents", {"cu": CU}),
])
def test_mutants_are_caught(pools, op, mutation, kw):
    results = _run(pools, op=op, U=1, R=2, layout="zigzag", mutation=mutation, **kw)
    worst = max(max(r.values()) for r in results)
    assert worst > 10, f"the {mutation} mutant of {op} went unnoticed (worst error / tolerance {worst:.3g})"


def test_bytes_sent_do_not_grow_with_the_sequence(pools):
    sent = [pools(2).run(dsp.bytes_sent, timeout=120, U=1, R=2, S=S)[0] for S in (64, 512)]
    assert sent[0] == sent[1] > 0
    # zigzag: two pieces a rank, each [P | S] of H=4 heads, dk=8, dv=8, float32; the all-gather sends it once
    assert sent[0] == sp.state_bytes(4, 8, 8, pieces_per_rank=2) * 1


# ----------------------------------------------------------------------------- single process
def test_plain_kernels_agree():
    g = torch.Generator().manual_seed(3)
    B, T, H, G, N, P = 2, 150, 4, 2, 3, 5
    x, dt = torch.randn(B, T, H, P, generator=g).double(), (torch.rand(B, T, H, generator=g) * 0.3).double()
    Bm, Cm = torch.randn(B, T, G, N, generator=g).double(), torch.randn(B, T, G, N, generator=g).double()
    A = -torch.rand(H, generator=g).double()
    h0 = torch.randn(B, H, N, P, generator=g).double()
    y1, s1 = sp.ssd_reference(x, dt, A, Bm, Cm, initial_state=h0)
    y2, s2 = sp.ssd_chunked(x, dt, A, Bm, Cm, initial_state=h0, chunk=32)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(s1, s2)


def test_delta_rule_reference_matches_transformers():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(4)
    B, T, Hk, Hv, dk, dv = 1, 37, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, dk, generator=g), torch.randn(B, T, Hk, dk, generator=g)
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, Hv, dv, generator=g)
    gg, beta = -torch.rand(B, T, Hv, generator=g), torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, dk, dv, generator=g)
    ours, st = sp.delta_rule_reference(*(t.double() for t in (q, k, v, gg, beta)), initial_state=s0.double())
    theirs, st2 = mod.torch_chunk_gated_delta_rule(q, k, v, gg, beta, chunk_size=8, initial_state=s0,
                                                   output_final_state=True)
    torch.testing.assert_close(theirs.double(), ours, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(st2.double(), st, atol=2e-4, rtol=2e-4)


def test_piece_plans():
    from dataclasses import dataclass

    @dataclass
    class M:
        ulysses_degree: int
        ring_degree: int
        use_ulysses_low: bool = True

        @property
        def sp_size(self):
            return self.ulysses_degree * self.ring_degree

        def ring_of(self, i):
            return i // self.ulysses_degree

        def ulysses_of(self, i):
            return i % self.ulysses_degree

    basic = sp.pieces(M(1, 2), 10, "basic")
    assert [(p.rank, p.start, p.length, p.doc_start) for p in basic] == [(0, 0, 5, True), (1, 5, 5, False)]
    zig = sp.pieces(M(1, 2), 8, "zigzag")
    # R=2: rank 1 holds chunks 1 and 2, adjacent: one piece
    assert [(p.rank, p.start, p.length) for p in zig] == [(0, 0, 2), (1, 2, 4), (0, 6, 2)]
    zig4 = sp.pieces(M(1, 4), 16, "zigzag")
    assert [(p.rank, p.start, p.length) for p in zig4] == [
        (0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 4), (2, 10, 2), (1, 12, 2), (0, 14, 2)]
    docs = sp.pieces(M(1, 2), 10, "basic", cu_seqlens=[0, 3, 10])
    assert [(p.rank, p.start, p.length, p.doc_start) for p in docs] == [
        (0, 0, 3, True), (0, 3, 2, True), (1, 5, 5, False)]


def test_wired_gdn_function_keeps_its_signature_outside_a_layer():
    """The hybrid integration replaces transformers' gated-delta-rule function for the whole
    process; outside a wired layer it must be the original however it is called (positional
    g and beta included, as state passing and FLA-style callers pass them)."""
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from usp_hal.integrations import sequence_mixers as hybrid
    original = mod.torch_chunk_gated_delta_rule
    routed = hybrid._gdn_route(original)
    g = torch.Generator().manual_seed(5)
    B, T, H, d = 1, 12, 2, 4
    q, k, v = (torch.randn(B, T, H, d, generator=g) for _ in range(3))
    gg, beta = -torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, d, d, generator=g)
    want = original(q, k, v, gg, beta, chunk_size=4, initial_state=s0, output_final_state=True)
    got = routed(q, k, v, gg, beta, chunk_size=4, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_a_rank_without_tokens_is_exact(pools):
    """A sequence shorter than the group (a rank holds no token): forward and gradients match
    the float64 whole sequence on every rank (its backward used to skip the gather's collective
    and leave the other ranks waiting: a timeout on 5edbecd)."""
    _assert_all_within(_run(pools, timeout=60, op="gdn", U=1, R=2, layout="basic", S=1))
    _assert_all_within(_run(pools, timeout=60, op="gdn", U=1, R=4, layout="zigzag", S=3))


@pytest.mark.parametrize("op", ["gdn", "conv"])
@pytest.mark.parametrize("sizes", [(9, 7), (7, 9)])
def test_lengths_that_do_not_fit_the_layout_are_refused_on_every_rank(pools, op, sizes):
    """Per-rank lengths that are not the layout's: the same refusal on every rank, before any
    data moves (on 5edbecd state passing raised on one rank and hung the other; the halo conv
    returned 8 rows for 9 or 7 tokens)."""
    texts = pools(2).run(dsp.misfit, timeout=60, op=op, sizes=sizes)
    assert len(set(texts)) == 1, texts
    assert texts[0].startswith("AgreementValueError") and f"per-rank lengths {list(sizes)}" in texts[0] \
        and "usp_hal.shard" in texts[0], texts
