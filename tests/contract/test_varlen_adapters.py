"""Packed documents through the FlashAttention adapters (stand-ins, see test_fa2.py).

The block plan cuts every kernel call at document boundaries, so the adapters serve packed
documents with their dense entry points.  This runs the ring's per-document calls in one
process (every ring rank simulated: plan_blocks on the layout's segments, the adapter's
forward on each call, the core's accumulator, then the adapter's backward against the merged
out/lse) and compares out, lse and gradients with float64 attention of each document alone.
"""
from __future__ import annotations

import pytest
import torch

from usp_hal.backends.fa2 import FlashAttn2Backend
from usp_hal.backends.fa3 import FlashAttn3Backend
from usp_hal.layout import ring_segments, segment_positions
from usp_hal.ring import _Accumulator, plan_blocks
from usp_hal.varlen import cu_seqlens_from_lengths, reference_packed_attention

from .standin import install_standin, purge_modules
from .standins_fa import FA2_DIST, FA2_TOP_LEVEL, FA3_DIST, FA3_TOP_LEVEL, assert_matches, fa2_files, fa3_files

pytestmark = pytest.mark.contract
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))   # FA2 and FA3 both run on sm90

# equal; one long + short ones and an empty one; lengths 1 and 2 (shorter than the ring)
DOCS = [(6, 6, 6, 6), (17, 1, 0, 2, 3), (1, 2, 1, 1, 2)]


@pytest.fixture
def adapter(tmp_path, monkeypatch):
    """install(kind) -> an adapter over its stand-in package ("fa2" 2.8.3 or "fa3" new API)."""
    purged = []

    def install(kind):
        if kind == "fa2":
            install_standin(tmp_path, monkeypatch, dist=FA2_DIST, version="2.8.3", files=fa2_files("2.8.3"))
            purged.append(FA2_TOP_LEVEL)
            return FlashAttn2Backend()
        install_standin(tmp_path, monkeypatch, dist=FA3_DIST, version="3.0.0b1", files=fa3_files("new"))
        purged.append(FA3_TOP_LEVEL)
        return FlashAttn3Backend()
    yield install
    for names in purged:
        purge_modules(names)


def _simulated_ring(backend, q, k, v, dout, cu, layout, R, causal, scale):
    """(out, lse, dq, dk, dv) in global order, as R ring ranks would compute them."""
    S = q.shape[1]
    segs = [ring_segments(layout, S, R, r, cu_seqlens=cu) for r in range(R)]
    pos = [segment_positions(s) for s in segs]
    kw = dict(softmax_scale=scale, window=(-1, -1), softcap=0.0, alibi_slopes=None)
    plans = {(me, src): plan_blocks(segs[me], segs[src], causal=causal, diagonal=me == src, cu_seqlens=cu)
             for me in range(R) for src in range(R)}
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[0], q.shape[2], S, dtype=torch.float32)
    for me in range(R):
        ql = q[:, pos[me]]
        acc = _Accumulator(ql, v.shape[-1])
        for src in range(R):
            kb, vb = k[:, pos[src]], v[:, pos[src]]
            for c in plans[me, src]:
                acc.add(c, *backend.forward(ql[:, c.rows], kb[:, c.cols], vb[:, c.cols], causal=c.causal,
                                            key_offset=c.key_offset, **kw))
        o, l = acc.result()
        out[:, pos[me]] = o.to(q.dtype)
        lse[:, :, pos[me]] = l.float()
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for (me, src), calls in plans.items():
        qp, kp = pos[me], pos[src]
        for c in calls:
            rows, cols = qp[c.rows], kp[c.cols]
            gq, gk, gv = backend.backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
                                          lse[:, :, rows], causal=c.causal, key_offset=c.key_offset,
                                          deterministic=False, dropout_p=0.0, **kw)
            dq[:, rows] += gq.float()
            dk[:, cols] += gk.float()
            dv[:, cols] += gv.float()
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout,R", [("basic", 1), ("zigzag", 2), ("varlen_zigzag", 4)])
@pytest.mark.parametrize("kind", ["fa2", "fa3"])
def test_adapters_serve_packed_documents_with_dense_calls(adapter, kind, layout, R, causal):
    backend = adapter(kind)
    dtype = torch.bfloat16
    for i, lengths in enumerate(DOCS):
        cu = cu_seqlens_from_lengths(lengths)
        S, H, Hkv, D = cu[-1], 4, 2, 16
        g = torch.Generator().manual_seed(i)
        q, dout = (torch.randn(1, S, H, D, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(1, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
        scale = D ** -0.5
        out, lse, dq, dk, dv = _simulated_ring(backend, q, k, v, dout, cu, layout, R, causal, scale)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        ro, rl = reference_packed_attention(qd, kd, vd, cu, softmax_scale=scale, causal=causal)
        ro.backward(dout.double())
        what = f"{kind} {layout} R={R} docs={lengths}"
        assert_matches(out, ro.detach(), dtype, f"{what} out")
        assert_matches(lse, rl.detach(), dtype, f"{what} lse")
        assert_matches(dq, qd.grad, dtype, f"{what} dq")
        assert_matches(dk, kd.grad, dtype, f"{what} dk")
        assert_matches(dv, vd.grad, dtype, f"{what} dv")
