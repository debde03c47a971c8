"""yunchang 0.6.4's behaviours that its test scripts do not reach alone: the placement
``EXTRACT_FUNC_DICT`` honours, ``UlyssesAttention`` built from a group, the ring functions,
the return values, ``attn_processor`` and the refusals (issue #38)."""
import pytest
import torch

import usp_hal
from tests import dist_yunchang
from usp_hal.dispatch.reference import reference_attention
from usp_hal.kernels import AttnType


@pytest.mark.multirank
@pytest.mark.parametrize("low", [True, False])
def test_extract_func_dict_follows_the_placement(pools, low):
    # before: every key cut shards as if Ulysses ranks came first, wrong with use_ulysses_low=False
    for rank, got in enumerate(pools(4).run(dist_yunchang.extract_follows_placement, timeout=120,
                                            use_ulysses_low=low)):
        assert all(got.values()), (rank, got)


@pytest.mark.multirank
def test_extract_func_dict_refuses_degrees_that_contradict_the_mesh(pools):
    # before: swapped rd/ud cut a ring-of-2 shard under a Ulysses-2 mesh, silently
    for errors, good in pools(2).run(dist_yunchang.extract_refuses_degrees_against_the_mesh, timeout=120):
        assert good
        for msg in errors:
            assert msg and "contradict" in msg and "rd=1, ud=2" in msg, errors


def test_extract_placement_without_a_mesh():
    x = torch.arange(16).view(1, 16)
    for rank in range(4):
        ring_low = usp_hal.EXTRACT_FUNC_DICT["zigzag"](x, rank, 4, 2, 2, use_ulysses_low=False)
        r, u = rank % 2, rank // 2                     # ring ranks consecutive
        chunks = x.chunk(4, dim=1)
        assert torch.equal(ring_low, torch.cat([chunks[r], chunks[3 - r]], dim=1).chunk(2, dim=1)[u])


@pytest.mark.multirank
@pytest.mark.parametrize("positional", [True, False])
def test_ulysses_attention_from_its_group(pools, positional):
    for errs in pools(4).run(dist_yunchang.ulysses_from_group, timeout=120, positional=positional):
        assert set(errs) == {"out", "dq", "dk", "dv"}, errs


@pytest.mark.multirank
@pytest.mark.parametrize("fn,layout,packed", [
    ("ring_flash_attn_func", "basic", ""),
    ("zigzag_ring_flash_attn_func", "zigzag", ""),
    ("stripe_flash_attn_func", "stripe", ""),
    ("zigzag_ring_flash_attn_qkvpacked_func", "zigzag", "qkv"),
    ("ring_flash_attn_kvpacked_func", "basic", "kv"),
])
def test_ring_functions_over_their_group(pools, fn, layout, packed):
    for errs in pools(4).run(dist_yunchang.ring_functions, timeout=120, fn_name=fn, layout=layout, packed=packed):
        assert {"out", "lse", "dq", "dk", "dv"} <= set(errs), errs


@pytest.mark.multirank
def test_ring_pytorch_and_a_processor_on_a_ring(pools):
    pools(2).run(dist_yunchang.ring_pytorch_returns_the_output, timeout=120)
    for msg, err in pools(2).run(dist_yunchang.processor_on_a_ring, timeout=120):
        assert msg and "log-sum-exp" in msg and err is not None, msg  # err: checked on the rank (_close)


def test_return_attn_probs_returns_the_output_and_return_lse_the_pair():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 12, 2, 8, generator=g, dtype=torch.float64)
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    out = attn(q, q, q, causal=True, return_attn_probs=True)
    assert isinstance(out, torch.Tensor)
    out2, lse = attn(q, q, q, causal=True, return_lse=True)
    ref, ref_lse = reference_attention(q, q, q, causal=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)
    torch.testing.assert_close(lse.double(), ref_lse)
    qkv = torch.stack([q, q, q], dim=2)
    packed = usp_hal.LongContextAttentionQKVPacked()                # yunchang's default scatter_idx=3
    assert isinstance(packed(qkv, causal=True, return_attn_probs=True), torch.Tensor)
    got, got_lse = packed(qkv, causal=True, return_lse=True)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_lse.double(), ref_lse)


class _SDPAProcessor(torch.nn.Module):
    """yunchang's attn_processor contract (the SPARSE_SAGE call): q/k/v [B, S, H, D] ("NHD")."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, q, k, v, is_causal=False, scale=None, tensor_layout="HND"):
        self.calls.append((tuple(q.shape), is_causal, scale, tensor_layout))
        t = lambda x: x.transpose(1, 2)    # noqa: E731
        return t(torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=is_causal, scale=scale))


def _flash_style(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, return_softmax=False):
    """yunchang's other attn_processor contract (an attn_type none of its members): flash_attn's
    forward signature, ``(out [B, S, H, D], lse [B, H, S])``."""
    t = lambda x: x.transpose(1, 2)    # noqa: E731
    s = t(q) @ t(k).transpose(-1, -2) * softmax_scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return t(torch.softmax(s, -1) @ t(v)), torch.logsumexp(s, -1)


def test_attn_processor_is_the_kernel():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 10, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref, ref_lse = reference_attention(q, k, v, causal=True, softmax_scale=0.3)
    proc = _SDPAProcessor()
    attn = usp_hal.LongContextAttention(attn_type=AttnType.SPARSE_SAGE, attn_processor=proc)
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v, causal=True, softmax_scale=0.3), ref)
    assert proc.calls[-1] == ((1, 10, 2, 8), True, 0.3, "NHD")
    # forward only, as yunchang's SPARSE_SAGE (its bwd-only stage raises)
    with pytest.raises(NotImplementedError, match="forward-only|backward"):
        attn(q.clone().requires_grad_(), k, v, causal=True)
    for attn_type in (None, "auto"):
        flash = usp_hal.LongContextAttention(attn_type=attn_type, attn_processor=_flash_style)
        with torch.no_grad():
            out, lse = flash(q, k, v, causal=True, softmax_scale=0.3, return_lse=True)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(lse.double(), ref_lse)


def test_varlen_ring_functions_refuse():
    q = torch.zeros(8, 2, 4)
    for name in ("ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_func"):
        with pytest.raises(NotImplementedError, match="global cu_seqlens"):
            getattr(usp_hal, name)(q, q, q, torch.tensor([0, 8]), 8)


def test_ulysses_attention_refuses_an_int_group():
    with pytest.raises(TypeError, match="sequence_process_group"):
        usp_hal.UlyssesAttention(2, 1)
