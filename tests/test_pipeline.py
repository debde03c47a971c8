"""The call pipeline's own contracts: options as one value, the per-signature cache, and the
backward that frees what it used."""
import pytest
import torch

import usp_hal
from usp_hal.dispatch.reference import reference_attention, tolerance
from usp_hal.pipeline import CallOptions


def _close(a, b, dtype=torch.float64):
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), atol=atol, rtol=rtol)


def test_options_round_trip_through_the_compiled_string():
    o = CallOptions.of(causal=True, softmax_scale=0.125, window_size=[3, -1], softcap=2.5, deterministic=True,
                       return_lse=True)
    back = CallOptions.decode(o.encode())
    assert back == o and hash(back) == hash(o)
    assert back.window == (3, -1) and back.scale == 0.125 and back.softcap == 2.5
    assert CallOptions.decode(CallOptions().encode()) == CallOptions()
    assert o.with_(causal=False).causal is False and o.causal is True


def test_compiled_op_takes_the_options_as_one_string():
    import usp_hal.pipeline.compiled  # noqa: F401  (registers the ops)
    schema = str(torch.ops.usp_hal.attention.default._schema)
    assert "str options" in schema and "softcap" not in schema and "window" not in schema, schema


def test_cached_signature_still_serves_every_shape_and_option():
    """Alternating shapes and options on one module: every call equals the float64 reference,
    so a cached spec or plan is never reused for another call."""
    g = torch.Generator().manual_seed(1)
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    cases = [(9, False, (-1, -1)), (12, True, (-1, -1)), (9, True, (2, 0)), (12, False, (-1, -1)), (9, False, (-1, -1))]
    for S, causal, window in cases * 2:
        q, k, v = (torch.randn(1, S, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
        out, lse = attn(q, k, v, causal=causal, window_size=window, return_lse=True)
        ref, ref_lse = reference_attention(q, k, v, causal=causal, window=window)
        _close(out, ref)
        _close(lse, ref_lse)
    assert len(attn.pipeline.signatures) == 4       # (9, full), (12, causal), (9, window), (12, full)


def test_tensor_scale_is_read_on_every_call():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 7, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    scale = torch.tensor(0.5, dtype=torch.float64)
    for value in (0.5, 0.1):
        scale.fill_(value)
        ref, _ = reference_attention(q, k, v, softmax_scale=value)
        _close(attn(q, k, v, softmax_scale=scale), ref)


def test_backward_twice_with_retain_graph_then_frees_its_saved_tensors():
    """A backward that keeps the graph keeps the saved tensors (a second one adds the same
    gradients again); one that does not frees them, and a further backward says so."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 10, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = usp_hal.LongContextAttention(attn_type="sdpa")(q, k, v, causal=True)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal=True)
    ref.sum().backward()
    for mine, theirs in ((q, qr), (k, kr), (v, vr)):
        _close(mine.grad, 2 * theirs.grad)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()


def test_a_gradient_through_the_returned_lse_is_refused_not_dropped():
    """The backward carries the output's gradient only: a loss that differentiates the lse
    returned by ``return_lse=True`` raises (naming ``lse.detach()`` and ``sinks=``) instead of
    training on a gradient without the lse's part; a detached or unused lse trains exactly."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 10, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    out, lse = attn(q, k, v, causal=True, return_lse=True)
    assert lse.requires_grad
    with pytest.raises(RuntimeError, match=r"lse.detach\(\).*sinks="):
        (out.sum() + lse.sum()).backward()
    out, lse = attn(q, k, v, causal=True, return_lse=True)
    (out.sum() + lse.detach().sum()).backward()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref, ref_lse = reference_attention(qr, kr, vr, causal=True)
    ref.sum().backward()
    _close(lse, ref_lse)
    for mine, theirs in ((q, qr), (k, kr), (v, vr)):
        _close(mine.grad, theirs.grad)
