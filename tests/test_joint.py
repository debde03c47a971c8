"""Joint (MMDiT) attention: joint tokens join once at the stated end; equal to single-device
attention on the concatenated sequence, forward and gradients (sharded and joint tensors)."""
import pytest

from tests import dist_joint

pytestmark = pytest.mark.multirank


def _ok(res):
    for errs in res:
        bad = {k: v for k, v in errs.items() if not v <= 1.0}
        assert not bad, f"{bad} (all {errs})"


@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("U,R,layout", [(2, 1, "zigzag"), (1, 2, "zigzag"), (1, 2, "basic"), (2, 2, "zigzag")])
def test_joint_equals_attention_on_the_concatenated_sequence(pools, strategy, causal, U, R, layout):
    _ok(pools(U * R).run(dist_joint.joint_case, timeout=90, U=U, R=R, strategy=strategy, causal=causal,
                         layout=layout))


@pytest.mark.parametrize("J", [1, 3, 9])
def test_joint_any_length_fp32_with_lse(pools, J):
    _ok(pools(4).run(dist_joint.joint_case, timeout=90, U=2, R=2, strategy="rear", causal=True, J=J, S=11,
                     dtype="fp32", return_lse=True))


@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize("mask", ["prefix_lm", "block_sparse", None], ids=["prefix_lm", "block_sparse", "no-mask"])
@pytest.mark.parametrize("U,R,layout", [(2, 1, "zigzag"), (1, 2, "zigzag"), (2, 2, "basic")])
def test_joint_tokens_with_mask_and_sinks(pools, strategy, mask, U, R, layout):
    # the mask is over the concatenated sequence (joint and main tokens) and the sinks join every row
    _ok(pools(U * R).run(dist_joint.joint_case, timeout=90, U=U, R=R, strategy=strategy, layout=layout, mask=mask,
                         sinks=True, S=13, J=6, return_lse=True))


def test_joint_stripe_non_causal(pools):
    _ok(pools(2).run(dist_joint.joint_case, timeout=60, U=1, R=2, layout="stripe", strategy="front"))


@pytest.mark.parametrize("what,needle", [("share", "tensor_split"), ("strategy", "joint_strategy"),
                                         ("cu_seqlens", "cu_seqlens together with joint tokens")])
def test_joint_refusals(pools, what, needle):
    for msg in pools(2).run(dist_joint.joint_refusal, timeout=60, what=what):
        assert msg and needle in msg, msg
