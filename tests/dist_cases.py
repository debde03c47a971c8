"""Functions that run on every rank of a WorkerPool (see tests/mp.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from usp_hal import KernelCall
from usp_hal.dispatch.reference import reference_attention, tolerance
from usp_hal.harness import CommMeter, compare

_MESHES = {}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def get_mesh(U: int, R: int, low: bool = True):
    key = (U, R, low)
    if key not in _MESHES:
        _MESHES[key] = usp_hal.init_sequence_parallel(U, R, use_ulysses_low=low, set_default=False)
    return _MESHES[key]


def _err(a: torch.Tensor, b: torch.Tensor, dtype, lse: bool = False) -> float:
    """max |a-b| / (atol + rtol*|b|): <= 1 means within tolerance."""
    return compare(a, b, *tolerance(dtype, lse=lse))["worst"]


def kernel_inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    """q ``[b, sq, h, d]``, k/v ``[b, sk, hkv, d]`` and dout in ``dtype``, from one seeded generator
    (a kernel test's inputs: the reference sees exactly these values, upcast)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    return q, k, v, dout


def kernel_call(**kw) -> KernelCall:
    """A :class:`~usp_hal.KernelCall` from the reference's keyword names (``softmax_scale`` for
    ``scale``), so that a test hands one set of options to the reference and the backend."""
    if "softmax_scale" in kw:
        kw["scale"] = kw.pop("softmax_scale")
    return KernelCall(**kw)


def merged_key_blocks(backend, q, k, v, dout, bounds, per_block=None, **kw):
    """The ring's kernel contract on one process: a forward over each key range of ``bounds``,
    the results merged by lse (in the lse's dtype), then each range's backward given the merged
    out/lse.  ``per_block(a, z)``: extra keywords for range ``a:z`` (key offset, mask slice).
    Returns ``(out, lse, dq, dk, dv, grads)``: dq summed over the ranges, dk/dv concatenated,
    and each range's own gradients."""
    extra = per_block or (lambda a, z: {})
    parts = [backend.forward(q, k[:, a:z], v[:, a:z], kernel_call(**kw, **extra(a, z))) for a, z in bounds]
    lse = parts[0][1]
    for _, pl in parts[1:]:
        lse = torch.logaddexp(lse, pl)
    # a row no range sees has lse -inf everywhere: its weights are 0, not NaN
    weights = [torch.exp(pl - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1) for _, pl in parts]
    out = sum(po.to(lse.dtype) * w for (po, _), w in zip(parts, weights)).to(q.dtype)
    grads = [backend.backward(dout, q, k[:, a:z], v[:, a:z], out, lse, kernel_call(**kw, **extra(a, z)))
             for a, z in bounds]
    dq = sum(g[0].to(lse.dtype) for g in grads)
    return out, lse, dq, torch.cat([g[1] for g in grads], 1), torch.cat([g[2] for g in grads], 1), grads


def error_of(fn):
    """``"Type: message"`` of what ``fn()`` raises, or None (for cases that collect refusals)."""
    try:
        fn()
    except Exception as exc:      # the refusals under test
        return f"{type(exc).__name__}: {exc}"
    return None


def lowest_peak(call, leaves, times=3):
    """``(bytes, method)``: the lowest of ``times`` peaks above the start (MemoryMeter, what
    ``usp-hal run`` reports) of ``call()``, each after clearing the ``leaves``' gradients; the
    lowest, since a gloo worker may hold a buffer past the meter's pause now and then."""
    from usp_hal.harness import meter
    peak = None
    for _ in range(times):
        for t in leaves:
            t.grad = None
        mem = meter.MemoryMeter("cpu")
        mem.start()
        call()
        got = mem.stop()
        peak = got if peak is None else min(peak, got)
    return peak, mem.method


def make_inputs(B, S, H, Hkv, D, dt, seed, alibi=False, Dv=None):
    """Global q, k, v, the output gradient (and alibi slopes), the same on every rank
    (``Dv``: the value head dim when it differs from the query/key one)."""
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    q = torch.randn(B, S, H, D, generator=g).to(dt)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dt)
    v = torch.randn(B, S, Hkv, Dv, generator=g).to(dt)
    dout = torch.randn(B, S, H, Dv, generator=g).to(dt)
    slopes = torch.rand(H, generator=g) * 0.5 if alibi else None
    return q, k, v, dout, slopes


def usp_case(U=1, R=1, low=True, layout="basic", rotation="p2p", causal=False, dtype="fp32", B=1, S=16, H=4,
             Hkv=None, D=8, window=(-1, -1), softcap=0.0, alibi=False, grad=True, return_lse=True, seed=0,
             attn_type="sdpa", scale=None, head_chunks=None, low_memory=False, Dv=None):
    """Sharded USP attention vs the float64 single-process reference on this rank's part
    (``Dv``: a value head dim other than ``D``, as in MLA).  Returns {name: normalised error}
    (<= 1 passes)."""
    mesh = get_mesh(U, R, low)
    dt = DTYPES[dtype]
    Hkv = Hkv or H
    q, k, v, dout, slopes = make_inputs(B, S, H, Hkv, D, dt, seed, alibi, Dv=Dv)
    # reference on the same (rounded) inputs, float64
    qr, kr, vr = (x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v))
    kw = dict(softmax_scale=scale, causal=causal, window=tuple(window), softcap=softcap, alibi_slopes=slopes)
    ro, rl = reference_attention(qr, kr, vr, **kw)
    rg = torch.autograd.grad(ro, (qr, kr, vr), dout.double()) if grad else None

    def sh(x, seq_dim=1):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim)

    ql, kl, vl = (sh(x).requires_grad_(grad) for x in (q, k, v))
    if head_chunks is None:
        attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type=attn_type, mesh=mesh, rotation=rotation,
                                            low_memory=low_memory)
    else:
        attn = usp_hal.AsyncLongContextAttention(ring_impl_type=layout, attn_type=attn_type, mesh=mesh,
                                                 rotation=rotation, head_chunks=head_chunks)
    res = attn(ql, kl, vl, softmax_scale=scale, causal=causal, window_size=tuple(window), softcap=softcap,
               alibi_slopes=slopes, return_lse=return_lse)
    return sharded_errors(res, return_lse, sh, dt, ro, rl, rg, dout, lambda: (ql.grad, kl.grad, vl.grad))


def sharded_errors(res, return_lse, sh, dt, ro, rl, rg=None, dout=None, grads=None) -> dict:
    """Normalised errors of a call's result (``out`` or ``(out, lse)``) against the global
    float64 reference (``ro``, ``rl``, gradients ``rg``), each compared on this rank's shard
    (``sh``); with ``rg``, runs the backward of ``dout`` and reads ``grads()``."""
    out, lse = res if return_lse else (res, None)
    errs = {"out": _err(out, sh(ro), dt)}
    if lse is not None:
        errs["lse"] = _err(lse, sh(rl, seq_dim=2), dt, lse=True)
    if rg is not None:
        out.backward(sh(dout))
        for name, t, r in zip(("dq", "dk", "dv"), grads(), rg):
            errs[name] = _err(t, sh(r), dt)
    return errs


def count_collectives(U=2, R=1, layout="basic", rotation="p2p", causal=True, S=16, H=4, D=8, return_lse=False,
                      Hkv=None, static=False, calls=1, Dv=None):
    """Count the collectives one forward and one backward issue on this rank (the last of
    ``calls`` calls of one module); ``Dv``: a value head dim of its own."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(1)
    x = [usp_hal.shard(torch.randn(1, S, h, d, generator=g), layout=layout, mesh=mesh).requires_grad_()
         for h, d in ((H, D), (Hkv or H, D), (Hkv or H, Dv or D))]
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh, rotation=rotation,
                                        static_shapes=static)
    for _ in range(calls - 1):
        attn(*x, causal=causal, return_lse=return_lse)
    with CommMeter() as meter:
        res = attn(*x, causal=causal, return_lse=return_lse)
        out = res[0] if return_lse else res
        fwd = dict(meter.calls)
        meter.reset()
        out.sum().backward()
        bwd = dict(meter.calls)
    return {"fwd": fwd, "bwd": bwd}


def expect_error(U=2, R=1, bad_rank=0, what="heads", layout="basic", **_):
    """One rank passes something different; every rank must raise (no hang)."""
    mesh = get_mesh(U, R)
    rank = dist.get_rank()
    H, Hkv, S, D = 4, 4, 8, 8
    dt = torch.float32
    if rank == bad_rank:
        if what == "heads":
            H = Hkv = 2
        elif what == "dtype":
            dt = torch.float64
        elif what == "causal":
            pass
        elif what == "dropout":
            pass
    q = torch.randn(1, S // mesh.sp_size, H, D, dtype=dt)
    k = torch.randn(1, S // mesh.sp_size, Hkv, D, dtype=dt)
    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)
    kw = {}
    if what == "causal" and rank == bad_rank:
        kw["causal"] = True
    if what == "dropout" and rank == bad_rank:
        kw["dropout_p"] = 0.1
    if what == "scale" and rank == bad_rank:
        kw["softmax_scale"] = 0.5
    if what == "deterministic" and rank == bad_rank:
        kw["deterministic"] = True
    attn(q, k, k.clone(), **kw)
    return "no error"


def fresh_call_after_error(U=2, R=1):
    """After a refused call the group must still work."""
    return usp_case(U=U, R=R, S=8, H=2, grad=False)


def wrong_lengths(U=1, R=2, causal=True):
    """Shards that do not match the layout (basic split passed to a zigzag module)."""
    mesh = get_mesh(U, R)
    x = torch.randn(1, 12, 2, 8)
    local = usp_hal.shard(x, layout="basic", mesh=mesh)
    if dist.get_rank() == 0:
        local = local[:, :-2]   # 4 + 6 tokens: zigzag for S=10 needs 5 + 5
    attn = usp_hal.LongContextAttention(ring_impl_type="zigzag", attn_type="sdpa", mesh=mesh)
    attn(local, local, local, causal=causal)
    return "no error"


def bad_rank_shape(U=2, R=1):
    """One rank passes a 3-D tensor: every rank must raise."""
    mesh = get_mesh(U, R)
    x = torch.randn(1, 4, 2, 8)
    if dist.get_rank() == 1:
        x = x[0]
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    attn(x, x, x)
    return "no error"


def refused_before_communication(U=2, R=1, what="forward_only_grad"):
    """A refusal must come before any data collective: count them while the call fails."""
    from usp_hal.backends.sdpa import SDPABackend

    class ForwardOnly(SDPABackend):
        NAME = "test_fwd_only"
        HAS_BACKWARD = False

    class NoLse(SDPABackend):
        NAME = "test_no_lse"
        RETURNS_LSE = False

    for cls in (ForwardOnly, NoLse):
        if cls.NAME not in usp_hal.list_backends():
            usp_hal.register_backend(cls.NAME, cls)
    mesh = get_mesh(U, R)
    name = {"forward_only_grad": "test_fwd_only", "no_lse_ring": "test_no_lse", "softcap": "sdpa"}[what]
    x = torch.randn(1, 4, 2, 8, requires_grad=what == "forward_only_grad")
    with CommMeter(("all_to_all_single", "batch_isend_irecv")) as meter:
        try:
            attn = usp_hal.LongContextAttention(attn_type=name, mesh=mesh)
            attn(x, x, x, softcap=30.0 if what == "softcap" else 0.0)
            return {"error": None, "counts": dict(meter.calls)}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "counts": dict(meter.calls)}


def forward_only_without_grad(U=1, R=2):
    """A forward-only backend that returns an lse serves the ring when no gradient is needed."""
    from usp_hal.backends.sdpa import SDPABackend

    class ForwardOnly(SDPABackend):
        NAME = "test_fwd_only2"
        HAS_BACKWARD = False

    if ForwardOnly.NAME not in usp_hal.list_backends():
        usp_hal.register_backend(ForwardOnly.NAME, ForwardOnly)
    return usp_case(U=U, R=R, causal=True, grad=False, attn_type="test_fwd_only2", S=12)


def api_surface(U=2, R=1):
    """The public names work as documented: set_seq_parallel_pg, shard/unshard, the 1-D classes,
    QKV-packed input, and a torch DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    assert usp_hal.set_seq_parallel_pg(U, R, rank, world) is None      # as yunchang's
    mesh = usp_hal.get_default_mesh()
    assert (mesh.ulysses_degree, mesh.ring_degree) == (U, R)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 11, 3, 8, generator=g)
    for layout in ("basic", "zigzag", "stripe"):
        back = usp_hal.unshard(usp_hal.shard(x, layout=layout), layout=layout)
        report[f"roundtrip_{layout}"] = bool(torch.equal(back, x))
    # default mesh + yunchang-style names
    q = usp_hal.shard(x, layout="zigzag").requires_grad_()
    cls = usp_hal.UlyssesAttention if R == 1 else usp_hal.RingAttention
    out = cls(attn_type="TORCH", ring_impl_type="zigzag")(q, q, q, causal=True)
    ref, _ = reference_attention(x.double(), x.double(), x.double(), causal=True)
    report["one_dim_class"] = _err(out, usp_hal.shard(ref, layout="zigzag"), torch.float32)
    qkv = torch.stack([q.detach()] * 3, dim=2)
    packed = usp_hal.LongContextAttentionQKVPacked(attn_type="sdpa", ring_impl_type="zigzag")(qkv, causal=True)
    report["packed"] = _err(packed, usp_hal.shard(ref, layout="zigzag"), torch.float32)
    # a torch DeviceMesh with named dims
    dm = init_device_mesh("cpu", (R, U), mesh_dim_names=("ring", "ulysses"))
    m2 = usp_hal.init_sequence_parallel(device_mesh=dm, set_default=False)
    report["device_mesh_degrees"] = (m2.ulysses_degree, m2.ring_degree)
    out2 = usp_hal.LongContextAttention(attn_type="sdpa", mesh=m2)(usp_hal.shard(x, mesh=m2), usp_hal.shard(x, mesh=m2),
                                                                  usp_hal.shard(x, mesh=m2), causal=True)
    report["device_mesh"] = _err(out2, usp_hal.shard(ref, mesh=m2), torch.float32)
    return report


def bad_degrees():
    errs = []
    for u, r in [(3, 1), (0, 2), (2, 3)]:
        try:
            usp_hal.init_sequence_parallel(u, r, set_default=False)
            errs.append(None)
        except ValueError as exc:
            errs.append(str(exc))
    return errs


def property_case(**kw):
    """usp_case, but a documented refusal is a result too: ("ok", errors) or ("refused", message)."""
    try:
        return ("ok", usp_case(**kw))
    except (NotImplementedError, ValueError) as exc:
        return ("refused", f"{type(exc).__name__}: {exc}")


def qkv_overlap_case(U=2, R=1, H=4, Hkv=2, D=8, S=14, causal=True, layout="zigzag", flat=True, grad=True,
                     low_memory=False, options=False):
    """async_qkv_attention (projections overlapped with the all-to-alls) vs projecting first and
    calling the module: same output, same gradients for the hidden states and the weights.
    ``options``: with a window, a scale, alibi slopes and ``return_lse`` too (the lse compared)."""
    mesh = get_mesh(U, R)
    g = torch.Generator().manual_seed(11)
    E = 16
    hidden = torch.randn(1, S, E, generator=g, dtype=torch.float64)
    lin = [torch.nn.Linear(E, h * D, bias=True).double() for h in (H, Hkv, Hkv)]
    for m in lin:
        for p in m.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    hl = usp_hal.shard(hidden, layout=layout, mesh=mesh).requires_grad_(grad)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh, low_memory=low_memory)

    def projs():
        if flat:
            return lin
        return [lambda x, m=m, h=h: m(x).view(x.shape[0], x.shape[1], h, D) for m, h in zip(lin, (H, Hkv, Hkv))]

    def grads():
        res = [hl.grad.clone()] + [p.grad.clone() for m in lin for p in m.parameters()]
        hl.grad = None
        for m in lin:
            m.zero_grad(set_to_none=True)
        return res

    kw: dict = dict(causal=causal)
    if options:
        kw.update(window_size=(4, 1), softmax_scale=0.3, return_lse=True,
                  alibi_slopes=torch.rand(H, generator=g, dtype=torch.float64))
    q, k, v = (m(hl).view(1, hl.shape[1], h, D) for m, h in zip(lin, (H, Hkv, Hkv)))
    ref = attn(q, k, v, **kw)
    ref, ref_lse = ref if options else (ref, None)
    if grad:
        ref.sum().backward()
        ref_g = grads()
    out = usp_hal.async_qkv_attention(attn, hl, *projs(), heads=H, kv_heads=Hkv, head_dim=D, **kw)
    errs = {}
    if options:
        out, lse = out
        errs["lse"] = _err(lse, ref_lse, torch.float64, lse=True)
    errs["out"] = _err(out, ref.detach(), torch.float64)
    if grad:
        out.sum().backward()
        for i, (a, b) in enumerate(zip(grads(), ref_g)):
            errs[f"g{i}"] = _err(a, b, torch.float64)
    return errs


def qkv_overlap_fp8_case(U=2):
    """With the fp8 wire format the overlapped path codes q and v like the packed path:
    identical outputs (same coding of the same values)."""
    mesh = get_mesh(U, 1)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 12, 16, generator=g)
    lin = [torch.nn.Linear(16, 4 * 8) for _ in range(3)]
    hl = usp_hal.shard(hidden, mesh=mesh)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, ulysses_float8=True)
    with torch.no_grad():
        q, k, v = (m(hl).view(1, hl.shape[1], 4, 8) for m in lin)
        ref = attn(q, k, v)
        out = usp_hal.async_qkv_attention(attn, hl, *lin, heads=4, head_dim=8)
    return float((out - ref).abs().max())


def cpu_side_group_case(U=2, R=1):
    """A mesh whose groups have no CPU transport (as with plain nccl) gets a gloo side group
    with the same timeout, and the per-call metadata exchange uses it."""
    import datetime

    import usp_hal.parallel.mesh as mesh_mod
    orig = mesh_mod._needs_cpu_side_group
    mesh_mod._needs_cpu_side_group = lambda group: True      # pretend the groups are accelerator-only
    try:
        mesh = usp_hal.init_sequence_parallel(U, R, set_default=False, timeout=datetime.timedelta(seconds=77))
    finally:
        mesh_mod._needs_cpu_side_group = orig
    from usp_hal.parallel.comm import group_timeout
    x = usp_hal.shard(torch.randn(1, 8, 2, 8, generator=torch.Generator().manual_seed(0)), mesh=mesh)
    # the metadata all-gather: all_gather_single from torch 2.13, all_gather_into_tensor before
    # (Ulysses-2 sends no data by all-gather)
    with CommMeter(("all_gather_single", "all_gather_into_tensor")) as meter:
        usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)(x, x, x)
    used = meter.groups["all_gather_single"] + meter.groups["all_gather_into_tensor"]
    return {"side": mesh.meta_group is not None and mesh.meta_group is not mesh.sp_group,
            "backend": str(dist.get_backend(mesh.meta_group)),
            "timeout": group_timeout(mesh.meta_group).total_seconds(),
            "metadata_on_side_group": bool(used) and all(g is mesh.meta_group for g in used)}


def profiler_labels(U=2, R=2, S=16, H=4, D=8):
    """The names of the ``usp_hal:`` labels a profiled forward+backward leaves in the trace."""
    mesh = get_mesh(U, R)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)
    g = torch.Generator().manual_seed(1)
    q, k, v = (usp_hal.shard(torch.randn(1, S, H, D, generator=g), layout="zigzag", mesh=mesh).requires_grad_()
               for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attn(q, k, v, causal=True).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("usp_hal: ")})


def ulysses_forward_case(U=2, layout="basic", causal=False, S=16, H=4, Hkv=None, D=8, dtype="fp32", calls=3,
                         return_lse=False, vary=False):
    """Forward-only Ulysses calls (no gradient), each compared with the float64 reference.
    With ``vary``, every call has inputs of its own and every output is kept and compared
    only after the last call (no result may share a buffer of a later call); ``a2a``: the
    all-to-alls of each call."""
    mesh = get_mesh(U, 1)
    dt = DTYPES[dtype]
    Hkv = Hkv or H

    def sh(x, seq_dim=1):
        return usp_hal.shard(x, layout=layout, mesh=mesh, seq_dim=seq_dim)

    attn = usp_hal.LongContextAttention(ring_impl_type=layout, attn_type="sdpa", mesh=mesh)
    kept, a2a = [], []
    real_a2a = dist.all_to_all_single
    count = [0]

    def counted(*a, **kw):
        count[0] += 1
        return real_a2a(*a, **kw)
    dist.all_to_all_single = counted
    try:
        with torch.no_grad():
            for i in range(calls):
                q, k, v, _, _ = make_inputs(1, S, H, Hkv, D, dt, seed=S + H + (i if vary else 0))
                # fresh (non-contiguous, for the odd calls) views each call
                ql, kl, vl = (sh(x) for x in (q, k, v))
                if i % 2:
                    ql, kl, vl = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (ql, kl, vl))
                count[0] = 0
                res = attn(ql, kl, vl, causal=causal, return_lse=return_lse)
                a2a.append(count[0])
                out, lse = res if return_lse else (res, None)
                kept.append((q, k, v, ql, out, lse))
    finally:
        dist.all_to_all_single = real_a2a
    errs = []
    for q, k, v, ql, out, lse in kept:
        ro, rl = reference_attention(q.double(), k.double(), v.double(), causal=causal)
        e = {"out": _err(out, sh(ro), dt), "shape": list(out.shape) == list(ql.shape[:3]) + [D],
             "dtype": out.dtype == dt}
        if lse is not None:
            e["lse"] = _err(lse, sh(rl, seq_dim=2), dt, lse=True)
        errs.append(e)
    return {"errs": errs, "a2a": a2a}
