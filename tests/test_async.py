"""AsyncLongContextAttention (head groups pipelined: the all-to-all of one group overlaps the
kernels of another) gives the synchronous path's results: forward and gradients vs float64,
any head count, GQA, uneven lengths, Ulysses x Ring."""
import pytest

from tests import dist_cases

pytestmark = pytest.mark.multirank


def _ok(res):
    for errs in res:
        bad = {k: v for k, v in errs.items() if not v <= 1.0}
        assert not bad, f"{bad} (all {errs})"


@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (6, 3), (5, 5), (3, 1), (1, 1)])
@pytest.mark.parametrize("chunks", [2, 3])
def test_async_ulysses_any_heads(pools, H, Hkv, chunks):
    _ok(pools(2).run(dist_cases.usp_case, timeout=60, U=2, R=1, H=H, Hkv=Hkv, S=13, causal=True, head_chunks=chunks))


@pytest.mark.parametrize("layout", ["zigzag", "basic"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_async_ulysses_by_ring(pools, layout, dtype):
    _ok(pools(4).run(dist_cases.usp_case, timeout=90, U=2, R=2, H=6, Hkv=2, S=22, causal=True, layout=layout,
                     dtype=dtype, head_chunks=2))


def test_async_with_alibi_window_and_lse(pools):
    _ok(pools(2).run(dist_cases.usp_case, timeout=60, U=2, R=1, H=4, S=16, causal=True, window=(5, 0),
                     alibi=True, head_chunks=2, dtype="fp64"))


@pytest.mark.parametrize("U,R,H,Hkv", [(2, 1, 4, 2), (2, 1, 6, 3), (2, 1, 3, 1), (2, 2, 4, 4), (1, 2, 4, 2)])
@pytest.mark.parametrize("flat", [True, False])
def test_qkv_projection_overlap_equals_projecting_first(pools, U, R, H, Hkv, flat):
    _ok(pools(U * R).run(dist_cases.qkv_overlap_case, timeout=60, U=U, R=R, H=H, Hkv=Hkv, flat=flat))


@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)])
def test_qkv_projection_overlap_carries_every_call_option(pools, U, R):
    """window, scale, alibi and return_lse given to async_qkv_attention (its **options) reach the
    overlapped call (U2) and the projecting-first one (R2) as they reach the module's."""
    _ok(pools(U * R).run(dist_cases.qkv_overlap_case, timeout=60, U=U, R=R, H=4, Hkv=2, options=True))


def test_qkv_projection_overlap_refuses_an_unknown_option_by_name():
    import torch

    import usp_hal
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    lin = torch.nn.Linear(8, 8)
    for bad, needle in (({"causal": True, "sofcap": 1.0}, "'sofcap'"), ({"mask": object()}, "does not take mask"),
                        ({"return_attn_probs": True}, "'return_attn_probs'")):
        with pytest.raises(TypeError, match=needle) as info:
            usp_hal.async_qkv_attention(attn, torch.ones(1, 4, 8), lin, lin, lin, heads=2, **bad)
        assert "async_qkv_attention" in str(info.value)


def test_qkv_projection_overlap_inference(pools):
    _ok(pools(2).run(dist_cases.qkv_overlap_case, timeout=60, U=2, R=1, grad=False))


def test_qkv_projection_overlap_codes_like_the_packed_path(pools):
    assert all(d <= 1e-6 for d in pools(2).run(dist_cases.qkv_overlap_fp8_case, timeout=60))
