"""Packed documents through the FlashAttention adapters (stand-ins, see test_fa2.py).

The block plan cuts every kernel call at document boundaries.  FA2 and FA3 have varlen
entry points, so the ring packs each step's calls into one varlen call per kind (causal
squares, full rectangles; ``usp_hal.parallel.ring.pack_calls``); any adapter also serves the same
calls one dense call each.  Here both ways run in one process (every ring rank simulated:
plan_blocks on the layout's segments, the adapter's calls, the core's accumulator, then the
adapter's backward against the merged out/lse) and out, lse and gradients are compared with
float64 attention of each document alone.  The varlen stand-ins follow each version's real
signatures and lse layout (see tests/contract/standins_fa.py); through
``LongContextAttention`` on 1 and 2 gloo ranks at the end.  These prove the adapters, not
the kernels.
"""
from __future__ import annotations

import pytest
import torch

from usp_hal import KernelCall
from usp_hal.backends.fa2 import FlashAttn2Backend
from usp_hal.backends.fa3 import FlashAttn3Backend
from usp_hal.dispatch.reference import reference_packed_attention
from usp_hal.parallel.ring import PackedCall, _Accumulator, pack_calls, plan_blocks
from usp_hal.sequence.positions import cu_seqlens_from_lengths, ring_segments, segment_positions

from . import usp_cases
from .standin import install_standin, purge_modules
from .standins_fa import FA2_DIST, FA2_TOP_LEVEL, FA3_DIST, FA3_TOP_LEVEL, assert_matches, fa2_files, fa3_files

pytestmark = pytest.mark.contract
FA2_VERSIONS = ["2.5.0", "2.5.9", "2.6.0", "2.6.3", "2.7.0", "2.8.3"]
EMULATE = dict(device_type="cuda", compute_capability=(9, 0))   # FA2 and FA3 both run on sm90

# equal; one long + short ones and an empty one; lengths 1 and 2 (shorter than the ring)
DOCS = [(6, 6, 6, 6), (17, 1, 0, 2, 3), (1, 2, 1, 1, 2)]


@pytest.fixture
def adapter(tmp_path, monkeypatch):
    """install(kind) -> an adapter over its stand-in package ("fa2" 2.8.3 or "fa3" new API)."""
    purged = []

    def install(kind, arg=None):
        if kind == "fa2":
            version = arg or "2.8.3"
            install_standin(tmp_path, monkeypatch, dist=FA2_DIST, version=version, files=fa2_files(version))
            purged.append(FA2_TOP_LEVEL)
            return FlashAttn2Backend()
        install_standin(tmp_path, monkeypatch, dist=FA3_DIST, version="3.0.0b1", files=fa3_files(arg or "new"))
        purged.append(FA3_TOP_LEVEL)
        return FlashAttn3Backend()
    yield install
    for names in purged:
        purge_modules(names)


def _simulated_ring(backend, q, k, v, dout, cu, layout, R, causal, scale, packed=False, window=(-1, -1),
                    softcap=0.0):
    """(out, lse, dq, dk, dv) in global order, as R ring ranks would compute them; ``packed``:
    each step's calls packed for the varlen entry point, as the ring does for FA2/FA3."""
    S = q.shape[1]
    segs = [ring_segments(layout, S, R, r, cu_seqlens=cu) for r in range(R)]
    pos = [segment_positions(s) for s in segs]
    base = KernelCall(scale=scale)
    positional = tuple(window) != (-1, -1)
    plans = {(me, src): plan_blocks(segs[me], segs[src], causal=causal, diagonal=me == src, cu_seqlens=cu,
                                    window=window, positional=positional)
             for me in range(R) for src in range(R)}
    if packed:
        return _simulated_packed(backend, q, k, v, dout, pos, plans, R, causal, scale, window, softcap)
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[0], q.shape[2], S, dtype=torch.float32)
    for me in range(R):
        ql = q[:, pos[me]]
        acc = _Accumulator(ql, v.shape[-1])
        for src in range(R):
            kb, vb = k[:, pos[src]], v[:, pos[src]]
            for c in plans[me, src]:
                acc.add(c, *backend.forward(ql[:, c.rows], kb[:, c.cols], vb[:, c.cols],
                                            base.with_(causal=c.causal, key_offset=c.key_offset)))
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
                                          lse[:, :, rows], base.with_(causal=c.causal, key_offset=c.key_offset))
            dq[:, rows] += gq.float()
            dk[:, cols] += gk.float()
            dv[:, cols] += gv.float()
    return out, lse, dq, dk, dv


def _simulated_packed(backend, q, k, v, dout, pos, plans, R, causal, scale, window, softcap):
    base = KernelCall(scale=scale, softcap=softcap, window=tuple(window))
    steps = {key: pack_calls(calls, windowed=tuple(window) != (-1, -1)) for key, calls in plans.items()}
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    for me in range(R):
        ql = q[:, pos[me]]
        acc = _Accumulator(ql, v.shape[-1])
        for src in range(R):
            kb, vb = k[:, pos[src]], v[:, pos[src]]
            for c in steps[me, src]:
                if isinstance(c, PackedCall):
                    o, lp = backend.forward_packed(c.gather(ql, "q"), c.gather(kb, "k"), c.gather(vb, "k"),
                                                   base.with_(packing=c.packing(q.shape[0], q.device), causal=c.causal))
                    acc.add_packed(c, o, lp)
                else:
                    acc.add(c, *backend.forward(ql[:, c.rows], kb[:, c.cols], vb[:, c.cols],
                                                base.with_(causal=c.causal, key_offset=c.key_offset)))
        o, l = acc.result()
        out[:, pos[me]] = o.to(q.dtype)
        lse[:, :, pos[me]] = l.float()
    grads = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
    for (me, src), cs in steps.items():
        ql, dol, ol, ll = q[:, pos[me]], dout[:, pos[me]], out[:, pos[me]], lse[:, :, pos[me]]
        kb, vb = k[:, pos[src]], v[:, pos[src]]
        gq_l, gk_l, gv_l = (torch.zeros(x.shape, dtype=torch.float32) for x in (ql, kb, vb))
        for c in cs:
            if isinstance(c, PackedCall):
                gq, gk, gv = backend.backward_packed(c.gather(dol, "q"), c.gather(ql, "q"), c.gather(kb, "k"),
                                                     c.gather(vb, "k"), c.gather(ol, "q"), c.gather_lse(ll),
                                                     base.with_(packing=c.packing(q.shape[0], q.device),
                                                                causal=c.causal))
                c.scatter_add(gq_l, gq, "q")
                c.scatter_add(gk_l, gk, "k")
                c.scatter_add(gv_l, gv, "k")
            else:
                gq, gk, gv = backend.backward(dol[:, c.rows], ql[:, c.rows], kb[:, c.cols], vb[:, c.cols],
                                              ol[:, c.rows], ll[:, :, c.rows],
                                              base.with_(causal=c.causal, key_offset=c.key_offset))
                gq_l[:, c.rows] += gq.float()
                gk_l[:, c.cols] += gk.float()
                gv_l[:, c.cols] += gv.float()
        grads[0][:, pos[me]] += gq_l
        grads[1][:, pos[src]] += gk_l
        grads[2][:, pos[src]] += gv_l
    n_packed = sum(isinstance(c, PackedCall) for cs in steps.values() for c in cs)
    return (out, lse, *grads), n_packed


def _inputs(lengths, seed, dtype, B=1, H=4, Hkv=2, D=16):
    cu = cu_seqlens_from_lengths(lengths)
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, cu[-1], H, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, cu[-1], Hkv, D, generator=g).to(dtype) for _ in range(2))
    return cu, q, k, v, dout


def _check_packed(result, q, k, v, dout, cu, causal, scale, dtype, what, **ref):
    out, lse, dq, dk, dv = result
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ro, rl = reference_packed_attention(qd, kd, vd, cu, softmax_scale=scale, causal=causal, **ref)
    ro.backward(dout.double())
    assert_matches(out, ro.detach(), dtype, f"{what} out")
    assert_matches(lse, rl.detach(), dtype, f"{what} lse")
    assert_matches(dq, qd.grad, dtype, f"{what} dq")
    assert_matches(dk, kd.grad, dtype, f"{what} dk")
    assert_matches(dv, vd.grad, dtype, f"{what} dv")


def _varlen_calls(kind):
    """The stand-in extension's record of varlen calls (cleared)."""
    import importlib
    mod = importlib.import_module("flash_attn_2_cuda" if kind == "fa2" else "flash_attn_3._C")
    calls = list(mod.VARLEN_CALLS)
    mod.VARLEN_CALLS.clear()
    return calls


# (kind, stand-in version/API, dtype, head dim): every FA2 API generation (varlen lse padded
# before 2.6, block_table without default 2.5.7-2.6.0, split window from 2.7) and both FA3 APIs;
# head dim 20 is padded to 24 by the adapter
PACKED_KERNELS = [("fa2", v, torch.float16 if v < "2.6" else torch.bfloat16, 20 if v == "2.5.9" else 16)
                  for v in FA2_VERSIONS] + [("fa3", "old", torch.float16, 16), ("fa3", "new", torch.bfloat16, 20)]


@pytest.mark.parametrize("kind,arg,dtype,D", PACKED_KERNELS, ids=[f"{k}-{a}" for k, a, _, _ in PACKED_KERNELS])
@pytest.mark.parametrize("layout,R", [("basic", 1), ("zigzag", 2), ("varlen_zigzag", 4)])
def test_ring_packs_each_step_into_varlen_calls(adapter, kind, arg, dtype, D, layout, R):
    """The varlen entry point of every version serves the packed steps exactly, and each
    packed step is one kernel call forward and one backward."""
    backend = adapter(kind, arg)
    assert backend.VARLEN_KERNEL
    total = 0
    for causal in (True, False):
        for i, lengths in enumerate(DOCS):
            cu, q, k, v, dout = _inputs(lengths, i, dtype, D=D)
            scale = D ** -0.5
            _varlen_calls(kind)
            result, n_packed = _simulated_ring(backend, q, k, v, dout, cu, layout, R, causal, scale, packed=True)
            _check_packed(result, q, k, v, dout, cu, causal, scale, dtype,
                          f"{kind} {arg} {layout} R={R} causal={causal} docs={lengths}")
            calls = _varlen_calls(kind)
            assert [d for d, _, _ in calls].count("fwd") == n_packed, calls
            assert [d for d, _, _ in calls].count("bwd") == n_packed, calls
            assert all(n >= 2 for _, _, n in calls), calls
            total += n_packed
    assert total > 0


def test_packed_steps_batch_documents(adapter):
    """Many documents on one rank: every document's causal square in one varlen call."""
    backend = adapter("fa2", "2.8.3")
    lengths = (3, 1, 4, 1, 5, 9, 2, 6)
    cu, q, k, v, dout = _inputs(lengths, 7, torch.bfloat16, B=2)
    _varlen_calls("fa2")
    result, n_packed = _simulated_ring(backend, q, k, v, dout, cu, "basic", 1, True, 0.25, packed=True)
    _check_packed(result, q, k, v, dout, cu, True, 0.25, torch.bfloat16, "8 documents, B=2")
    assert n_packed == 1
    assert _varlen_calls("fa2") == [("fwd", True, 2 * len(lengths)), ("bwd", True, 2 * len(lengths))]


@pytest.mark.parametrize("kind,arg,dtype", [("fa2", "2.8.3", torch.bfloat16), ("fa2", "2.5.9", torch.float16),
                                            ("fa3", "new", torch.bfloat16), ("fa3", "old", torch.float16)])
def test_packed_steps_with_window_and_softcap(adapter, kind, arg, dtype):
    """A sliding window (and softcap where the version has it) on one ring rank: every
    document's square has key offset 0, so the varlen call's per-sequence window is the
    contract's and the squares are packed."""
    backend = adapter(kind, arg)
    softcap = 0.0 if arg == "2.5.9" else 2.5
    for causal, window in ((True, (3, 0)), (False, (2, 1)), (True, (0, 0))):
        cu, q, k, v, dout = _inputs((9, 1, 2, 12, 5), 11, dtype)
        _varlen_calls(kind)
        result, n_packed = _simulated_ring(backend, q, k, v, dout, cu, "basic", 1, causal, 0.3, packed=True,
                                           window=window, softcap=softcap)
        _check_packed(result, q, k, v, dout, cu, causal, 0.3, dtype, f"{kind} {arg} window={window}",
                      window=window, softcap=softcap)
        assert n_packed == 1 and len(_varlen_calls(kind)) == 2


def test_windowed_plan_packs_only_squares_without_offset():
    """With a window a varlen call anchors it at each sequence's own corner: calls with a key
    offset (zigzag pieces of one document on two ring ranks) stay plain calls."""
    cu = cu_seqlens_from_lengths((16, 16))
    segs = [ring_segments("zigzag", 32, 2, r, cu_seqlens=cu) for r in range(2)]
    calls = plan_blocks(segs[0], segs[1], causal=True, cu_seqlens=cu, window=(6, 0), positional=True)
    assert any(c.key_offset != 0 for c in calls)
    steps = pack_calls(calls, windowed=True)
    for st in steps:
        for c in (st.calls if isinstance(st, PackedCall) else (st,)):
            if isinstance(st, PackedCall):
                assert c.key_offset == 0 and c.q_stop - c.q_start == c.k_stop - c.k_start
    assert sorted(((c.q_start, c.k_start) for st in steps for c in (st.calls if isinstance(st, PackedCall)
                                                                       else (st,)))) == \
        sorted((c.q_start, c.k_start) for c in calls)


def test_fa3_build_without_varlen_serves_packed_calls_densely(adapter):
    """A FlashAttention-3 build compiled with FLASHATTENTION_DISABLE_VARLEN refuses cu_seqlens
    (hopper/flash_api.cpp); the adapter then runs one dense call per sequence, still exact."""
    import importlib
    backend = adapter("fa3", "new")
    importlib.import_module("flash_attn_3._C").VARLEN_DISABLED = True
    cu, q, k, v, dout = _inputs((5, 3, 8), 3, torch.bfloat16)
    result, n_packed = _simulated_ring(backend, q, k, v, dout, cu, "zigzag", 2, True, 0.25, packed=True)
    _check_packed(result, q, k, v, dout, cu, True, 0.25, torch.bfloat16, "no-varlen build")
    assert n_packed > 0 and backend._dense_only


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


# ------------------------------------------------------------------ through LongContextAttention
CUDA90 = dict(device_type="cuda", compute_capability=(9, 0))
THROUGH = [("fa2-2.8.3", {"kind": "fa2", "arg": "2.8.3"}, "fa2", "bf16"),
           ("fa2-2.5.9", {"kind": "fa2", "arg": "2.5.9"}, "fa2", "fp16"),
           ("fa3-new", {"kind": "fa3", "arg": "new"}, "fa3", "bf16")]
WINDOWED = [("fa2-2.8.3", {"kind": "fa2", "arg": "2.8.3"}, "fa2", "bf16", 2.0),
            ("fa3-old", {"kind": "fa3", "arg": "old"}, "fa3", "fp16", 3.0)]
MESHES = [(1, 1, 1, "basic"), (2, 1, 2, "varlen_zigzag"), (2, 2, 1, "basic")]


@pytest.mark.multirank
@pytest.mark.parametrize("mesh", MESHES, ids=[f"w{w}-u{u}r{r}-{lay}" for w, u, r, lay in MESHES])
@pytest.mark.parametrize("name,standin,attn_type,dtype", THROUGH, ids=[t[0] for t in THROUGH])
def test_packed_documents_through_long_context_attention(pools, name, standin, attn_type, dtype, mesh):
    """cu_seqlens through LongContextAttention with the FA adapters' varlen entry points (two
    batch rows sharing the boundaries): out, lse and gradients against float64 per-document
    attention, and the kernel called through its varlen entry point at most twice per ring
    step and direction."""
    world, U, R, layout = mesh
    docs = ((9, 1, 2, 12), (6, 6, 6, 6), (1, 2, 1, 1, 2, 17))
    res = pools(world).run(usp_cases.packed_adapter_case, timeout=120, standin=standin, emulate=CUDA90,
                           attn_type=attn_type, U=U, R=R, layout=layout, dtype=dtype, docs=docs, H=4, Hkv=2, D=16,
                           B=2)
    for rank in res:
        for errs in rank["errors"]:
            bad = {k: v for k, v in errs.items() if not v <= 1.0}
            assert not bad and set(errs) >= {"out", "lse", "dq", "dk", "dv"}, errs
        fwd = [c for c in rank["varlen_calls"] if c[0] == "fwd"]
        bwd = [c for c in rank["varlen_calls"] if c[0] == "bwd"]
        assert fwd and len(fwd) == len(bwd), rank["varlen_calls"]
        assert len(fwd) <= 2 * R * len(docs), rank["varlen_calls"]


@pytest.mark.multirank
@pytest.mark.parametrize("world,U", [(1, 1), (2, 2)], ids=["w1", "u2"])
@pytest.mark.parametrize("name,standin,attn_type,dtype,softcap", WINDOWED, ids=[t[0] for t in WINDOWED])
def test_packed_window_softcap_through_long_context_attention(pools, name, standin, attn_type, dtype, softcap,
                                                               world, U):
    """Sliding window and softcap with packed documents (Ulysses only: these kernels take no key
    offset across ring blocks): exact, through the varlen entry point."""
    docs = ((9, 1, 2, 12), (1, 2, 1, 1, 2, 17))
    res = pools(world).run(usp_cases.packed_adapter_case, timeout=120, standin=standin, emulate=CUDA90,
                           attn_type=attn_type, U=U, R=1, layout="basic", dtype=dtype, docs=docs, H=4, Hkv=2, D=16,
                           window=(4, 0), softcap=softcap)
    for rank in res:
        for errs in rank["errors"]:
            bad = {k: v for k, v in errs.items() if not v <= 1.0}
            assert not bad and set(errs) >= {"out", "lse", "dq", "dk", "dv"}, errs
        assert [c[0] for c in rank["varlen_calls"]].count("fwd") == len(docs), rank["varlen_calls"]


@pytest.mark.parametrize("kind,arg", [("fa2", "2.5.9"), ("fa2", "2.8.3"), ("fa3", "old"), ("fa3", "new")])
def test_probe_verify_checks_the_varlen_entry_point(adapter, kind, arg, monkeypatch):
    """`usp-hal probe --verify` and the CI matrix entries (verify_backend) run the packed
    cases for a backend with a varlen entry point: on a GPU runner that checks the real
    kernel; here the stand-in, on the CPU tensors the emulated device stands for."""
    from usp_hal.harness import verify
    cls = type(adapter(kind, arg))
    monkeypatch.setattr(verify._platform, "torch_device_name", lambda device_type: "cpu")
    rows = verify.verify_backend(cls, "cuda")
    cases = {(r["dtype"], r["case"]): r for r in rows}
    for dtype in ("bf16", "fp16"):
        for case in ("packed", "packed-causal"):
            row = cases[(dtype, case)]
            assert row["status"] == "pass", row
            assert set(row["errors"]) == {"out", "lse", "dq", "dk", "dv"}, row
    assert all(r["status"] in ("pass", "skip") for r in rows), [r for r in rows if r["status"] == "fail"]


def test_verify_packed_case_fails_a_wrong_varlen_kernel(adapter):
    """The packed check can fail: a kernel whose varlen lse is read in the wrong layout."""
    from usp_hal.harness.verify import verify_packed_case
    backend = adapter("fa2", "2.5.9")
    ok = verify_packed_case(type(backend), "cpu", torch.float16, 64, causal=True)
    assert ok["ok"], ok
    kernel = backend._kernel()
    kernel.unpadded_lse = True          # pretend 2.5.9 already returned [H, total_q]
    cls = type(backend)
    bad = cls.__new__(cls)
    bad._loaded_kernel = kernel
    res = verify_packed_case(lambda: bad, "cpu", torch.float16, 64, causal=True)
    assert not res["ok"], res


@pytest.mark.multirank
@pytest.mark.parametrize("module", ["async", "qkvpacked"])
def test_packed_fa_calls_in_the_other_modules(pools, module):
    """AsyncLongContextAttention (two head groups pipelined) and the QKV-packed module run the
    same packed varlen calls: exact against per-document float64 attention."""
    res = pools(2).run(usp_cases.packed_adapter_case, timeout=120, standin={"kind": "fa2", "arg": "2.8.3"},
                       emulate=CUDA90, attn_type="fa2", U=2, R=1, layout="basic", dtype="bf16",
                       docs=((9, 1, 2, 12),), H=4, Hkv=4, D=16, module=module)
    for rank in res:
        for errs in rank["errors"]:
            bad = {k: v for k, v in errs.items() if not v <= 1.0}
            assert not bad and set(errs) >= {"out", "lse", "dq", "dk", "dv"}, errs
        assert [c[0] for c in rank["varlen_calls"]].count("fwd") >= 1, rank["varlen_calls"]


@pytest.mark.multirank
def test_packed_documents_with_a_value_head_dim_of_its_own_through_fa3(pools):
    """Dk != Dv (16 and 40) with packed documents on a 2-rank ring through FA3's varlen entry
    point (stand-in): out, lse and gradients against float64 per-document attention."""
    docs = ((9, 1, 2, 12), (1, 2, 1, 1, 2, 17))
    res = pools(2).run(usp_cases.packed_adapter_case, timeout=120, standin={"kind": "fa3", "arg": "new"},
                       emulate=CUDA90, attn_type="fa3", U=1, R=2, layout="varlen_zigzag", dtype="bf16", docs=docs,
                       H=4, Hkv=2, D=16, Dv=40)
    for rank in res:
        for errs in rank["errors"]:
            bad = {k: v for k, v in errs.items() if not v <= 1.0}
            assert not bad and set(errs) >= {"out", "lse", "dq", "dk", "dv"}, errs
        assert any(c[0] == "fwd" for c in rank["varlen_calls"]), rank["varlen_calls"]
