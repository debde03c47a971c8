"""Multi-head latent attention shapes (query/key head dim != value head dim, as in DeepSeek-V2/V3
and kimi_linear): USP attention against float64 single-process attention on 1, 2 and 4 gloo
ranks, forward and gradients, over the splits, layouts and rotations, GQA included; packed
documents, masks with sinks, the fp8 wire, head groups and low_memory; and a tiny DeepSeek-V3
through the transformers integration against one process."""
import pytest

from tests import dist_cases, dist_masks, dist_varlen, integration_cases

pytestmark = pytest.mark.multirank

# (world, U, R, ulysses ranks contiguous, layout, rotation, causal, dtype, H, Hkv, Dk, Dv)
CASES = [
    (1, 1, 1, True, "basic", "p2p", True, "fp64", 4, 2, 12, 8),
    (2, 2, 1, True, "zigzag", "p2p", True, "fp32", 4, 2, 12, 8),
    (2, 2, 1, True, "stripe", "p2p", False, "bf16", 4, 4, 12, 8),
    (2, 1, 2, True, "zigzag", "p2p", True, "fp32", 4, 2, 12, 8),
    (2, 1, 2, True, "basic", "allgather", True, "fp64", 4, 1, 8, 12),     # Dv > Dk, MQA
    (2, 1, 2, True, "stripe", "allgather", False, "fp32", 4, 2, 12, 8),
    (4, 2, 2, True, "zigzag", "p2p", True, "fp32", 4, 2, 12, 8),
    (4, 2, 2, False, "zigzag", "allgather", True, "fp32", 4, 2, 12, 8),
    (4, 4, 1, True, "basic", "p2p", True, "fp32", 6, 2, 12, 8),           # GQA groups cut across ranks
    (4, 1, 4, True, "stripe", "p2p", True, "fp32", 4, 2, 8, 12),
]


def _ok(errs):
    bad = {k: v for k, v in errs.items() if not v <= 1.0}
    assert not bad, f"errors above tolerance (1.0 = limit): {bad} (all: {errs})"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0]}-u{c[1]}r{c[2]}{'' if c[3] else '-ringlow'}-{c[4]}-"
                         f"{c[5]}-{'causal' if c[6] else 'full'}-{c[7]}-h{c[8]}/{c[9]}-d{c[10]}/{c[11]}")
def test_mla_attention_matches_float64(pools, case):
    world, U, R, low, layout, rotation, causal, dtype, H, Hkv, Dk, Dv = case
    for errs in pools(world).run(dist_cases.usp_case, timeout=120, U=U, R=R, low=low, layout=layout,
                                 rotation=rotation, causal=causal, dtype=dtype, B=2, S=24, H=H, Hkv=Hkv, D=Dk, Dv=Dv):
        assert set(errs) == {"out", "lse", "dq", "dk", "dv"}
        _ok(errs)


@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_mla_with_documents_masks_sinks_and_head_groups(pools, U, R):
    pool = pools(2)
    for module in ("plain", "async"):
        for res in pool.run(dist_varlen.packed_case, timeout=120, U=U, R=R, layout="zigzag", causal=True, dtype="fp64",
                            H=4, Hkv=2, D=12, Dv=8, docs=((5, 7, 4),), module=module):
            _ok(res[0])
    for module in ("plain", "async", "low_memory"):
        for res in pool.run(dist_masks.mask_case, timeout=120, U=U, R=R, layout="zigzag", fam="prefix_lm",
                            dtype="fp64", H=4, Hkv=2, D=12, Dv=8, sinks=True, module=module):
            assert "dsinks" in res["errs"]
            _ok(res["errs"])


@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_mla_over_the_fp8_wire(pools, U, R):
    for res in pools(2).run(dist_masks.mask_case, timeout=120, U=U, R=R, layout="zigzag", fam="prefix_lm",
                            dtype="bf16", H=4, Hkv=2, D=12, Dv=8, fp8=True):
        _ok(res["errs"])


@pytest.mark.parametrize("world,U,R", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["u2", "r2", "u2r2"])
def test_tiny_deepseek_v3_matches_one_process(pools, world, U, R):
    r = pools(world).run(integration_cases.model_matches_one_process, timeout=240, family="deepseek_v3", U=U, R=R,
                         layout="zigzag", attn_type="auto", steps=2)[0]
    assert r["logits_diff"] <= 2e-5, r
    assert r["loss_diff"] <= 2e-5, r
    assert r["grad_diff"] <= 2e-5 * max(1.0, r["grad_scale"]), r
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 5e-5, r
    assert r["losses"][-1] < r["losses"][0], r          # the AdamW steps trained the model


def test_mla_forward_through_flex(pools):
    """flex on the CPU (forward only): Dk != Dv with softcap across ring blocks."""
    for errs in pools(2).run(dist_cases.usp_case, timeout=120, U=1, R=2, layout="zigzag", causal=True, dtype="fp32",
                             S=24, H=4, Hkv=2, D=12, Dv=8, softcap=3.0, grad=False, attn_type="flex"):
        assert set(errs) == {"out", "lse"}
        _ok(errs)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2)])
def test_mla_ulysses_moves_qkv_in_one_all_to_all(pools, H, Hkv):
    """A value head dim of its own costs no extra collective: q, k and v still travel in one
    all-to-all (and dq/dk/dv in one), the output and its gradient in one each."""
    for res in pools(2).run(dist_cases.count_collectives, U=2, R=1, H=H, Hkv=Hkv, D=12, Dv=8):
        assert res["fwd"]["all_to_all_single"] == 2, res
        assert res["bwd"]["all_to_all_single"] == 2, res
