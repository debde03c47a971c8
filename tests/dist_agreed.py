"""Rank-side functions of tests/test_agreed_errors.py: one rank's bad input or mask is an
error on every rank (never a hang, never a silently wrong result), masks are compared by what
they select, and a mask's data is never stale."""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

import usp_hal
from tests.dist_cases import _err, get_mesh
from usp_hal.dispatch.reference import reference_attention
from usp_hal.sequence import masks as M

S, H, D = 32, 2, 8
GLOBAL_N = 4          # read by global_chunk_mod (a bare mask_mod reading a global)


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, S, H, D, generator=g, dtype=dtype) for _ in range(3))


def _ref(q, k, v, mask=None, causal=False, scale=None):
    dense = None if mask is None else M.Mask.of(mask).keep(torch.arange(S), torch.arange(S))
    return reference_attention(q, k, v, causal=causal, mask=dense, softmax_scale=scale)[0]


def _call(attn, mesh, q, k, v, **kw):
    """(error text or None, error of the output against float64 or None, seconds)."""
    t0 = time.monotonic()
    ql, kl, vl = (usp_hal.shard(x, mesh=mesh) for x in (q, k, v))
    try:
        out = attn(ql, kl, vl, **kw)
    except Exception as exc:     # noqa: BLE001 - the error text is the result
        return f"{type(exc).__name__}: {exc}", None, time.monotonic() - t0
    ref = _ref(q, k, v, mask=kw.get("mask"), causal=kw.get("causal", False), scale=kw.get("softmax_scale"))
    return None, _err(out, usp_hal.shard(ref, mesh=mesh), torch.float64), time.monotonic() - t0


def _after(attn, mesh):
    """The group still pairs calls correctly: a plain call matches float64."""
    q, k, v = _inputs(7)
    return _call(attn, mesh, q, k, v, causal=True)[1]


# ----------------------------------------------------------------------------- 8: scales
def scale_case(scale, only_rank=None):
    mesh = get_mesh(1, 2)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    q, k, v = _inputs()
    mine = scale if only_rank is None or dist.get_rank() == only_rank else 0.5
    err, worst, _ = _call(attn, mesh, q, k, v, causal=True, softmax_scale=mine)
    return {"error": err, "worst": worst, "after": _after(attn, mesh)}


# ----------------------------------------------------------------------------- 10: wrong shape
def wrong_shape_case():
    mesh = get_mesh(1, 2)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)

    def flat_mask_mod(b, h, q, kv):
        return (kv <= q).reshape(-1)
    q, k, v = _inputs()
    return {"error": _call(attn, mesh, q, k, v, mask=flat_mask_mod)[0], "after": _after(attn, mesh)}


# ----------------------------------------------------------------------------- 3: every form
def _chunk(b, h, q, kv, n):
    return kv // n == q // n


class ChunkMask:
    def __init__(self, n):
        self.n = n

    def __call__(self, b, h, q, kv):
        return kv // self.n == q // self.n


def global_chunk_mod(b, h, q, kv):
    return kv // GLOBAL_N == q // GLOBAL_N


def make_mask(form: str, p: int):
    """A mask of ``form`` with parameter ``p`` (1 <= p <= S)."""
    global GLOBAL_N
    if form == "partial":
        return functools.partial(_chunk, n=p)
    if form == "default":
        return lambda b, h, q, kv, n=p: kv // n == q // n
    if form == "object":
        return ChunkMask(p)
    if form == "list":
        box = [p]
        return lambda b, h, q, kv: kv // box[0] == q // box[0]
    if form == "tensor":
        docs = torch.arange(S) // p

        def doc_mod(b, h, q, kv):
            return docs[q] == docs[kv]
        return doc_mod
    if form == "global":
        GLOBAL_N = p
        return global_chunk_mod
    if form == "mask":
        return M.Mask.from_mod(lambda b, h, q, kv: (kv // p == q // p) | (kv < 1))
    if form == "slices":
        return M.Mask.from_slices([((0, S), (0, p), "full"), ((p, S), (p, S), "causal")])
    if form == "helper":
        return M.chunked_local(p)
    raise ValueError(form)


def forms_case(forms, params, causal=False):
    """Rank r passes ``make_mask(forms[r], params[r])``; returns the error and the float64 error."""
    mesh = get_mesh(1, dist.get_world_size())
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    r = dist.get_rank()
    q, k, v = _inputs()
    err, worst, elapsed = _call(attn, mesh, q, k, v, mask=make_mask(forms[r], params[r]), causal=causal)
    # a second call (the steady state: the digest compared in the first agreement)
    err2, worst2, _ = _call(attn, mesh, q, k, v, mask=make_mask(forms[r], params[r]), causal=causal)
    return {"error": err, "worst": worst, "error2": err2, "worst2": worst2, "elapsed": elapsed,
            "after": _after(attn, mesh)}


# ----------------------------------------------------------------------------- 4: stale data
def changing_data_case(how="tensor", ranks_differ=False):
    """The mask's data change between calls (in place, or a global a bare mask_mod reads):
    every call matches float64 with the data of that call."""
    global GLOBAL_N
    mesh = get_mesh(1, dist.get_world_size())
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    q, k, v = _inputs(3)
    docs = torch.zeros(S, dtype=torch.long)

    array = None
    if how == "from_numpy":        # a loader's buffer, refilled in place: no tensor version bump
        import numpy as np
        array = np.zeros(S, dtype=np.int64)
        docs = torch.from_numpy(array)
    elif how == "numpy_view":      # written through a NumPy view of the tensor's memory
        array = docs.numpy()

    def docs_mod(b, h, q, kv):
        return docs[q] == docs[kv]
    if how in ("dot_data", "numpy_view"):      # unversioned writes: the data passed explicitly
        mask = M.Mask.from_mod(docs_mod, data=docs)
    elif how == "global":
        mask = global_chunk_mod
    else:
        mask = M.Mask.from_mod(docs_mod)
    out = []
    for step, n in enumerate((32, 4, 8, 8, 16)):
        if ranks_differ and step == 2 and dist.get_rank() == 1:
            n = 2
        if how == "tensor":
            docs.copy_(torch.arange(S) // n)       # in place: the same tensor, a new version
        elif how == "dot_data":
            docs.data.copy_(torch.arange(S) // n)  # through .data: the same version
        elif array is not None:
            array[:] = (torch.arange(S) // n).numpy()
        else:
            GLOBAL_N = n
        err, worst, _ = _call(attn, mesh, q, k, v, mask=mask)
        out.append((err, worst))
    return out


# ----------------------------------------------------------------------------- 2: a raising mask_mod
def raising_mask_case(steady: bool, check_ranks: str = "every_call"):
    """Rank 1's mask_mod indexes a closed-over tensor that is too short there (an IndexError)."""
    mesh = get_mesh(1, 2)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, check_ranks=check_ranks)
    q, k, v = _inputs()
    docs = torch.arange(S) // 8

    def short_docs_mod(b, h, q, kv):
        return docs[q] == docs[kv]
    if steady:      # a first call of the same length passes on both ranks
        _call(attn, mesh, q, k, v, mask=M.chunked_local(8))
    if dist.get_rank() == 1:
        docs = docs[:S // 2]
    err, _, elapsed = _call(attn, mesh, q, k, v, mask=short_docs_mod)
    return {"error": err, "elapsed": elapsed, "after": _after(attn, mesh)}


# ----------------------------------------------------------------------------- 6: sinks
def sinks_case(what: str):
    """Sink logits: ``what`` = "same" (they agree: float64 result and gradients), "values"
    (rank 1's differ), "grad" (rank 1's do not require grad), "inplace" (rank 1 changes its
    sinks in place after two equal calls).  Also counts the digests taken (host reads of the
    sinks) over the steady calls."""
    from usp_hal.pipeline import spec as _spec
    mesh = get_mesh(1, 2)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    r = dist.get_rank()
    q, k, v = _inputs(2)
    base = torch.tensor([0.3, -1.2], dtype=torch.float64)
    sinks = base.clone()
    if what == "values" and r == 1:
        sinks = base * 2
    sinks.requires_grad_(not (what == "grad" and r == 1))
    ql, kl, vl = (usp_hal.shard(x, mesh=mesh).requires_grad_() for x in (q, k, v))
    reads = [0]
    real = _spec.digest_tensor

    def counting(t):
        reads[0] += 1
        return real(t)
    _spec.digest_tensor = counting
    try:
        errors, outs = [], []
        for step in range(4):
            if what == "inplace" and step == 2 and r == 1:
                with torch.no_grad():
                    sinks.mul_(3)
            try:
                outs.append(attn(ql, kl, vl, causal=True, sinks=sinks))
                errors.append(None)
            except Exception as exc:      # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        _spec.digest_tensor = real
    res = {"errors": errors, "reads": reads[0], "after": _after(attn, mesh)}
    if what == "same":
        qr, kr, vr, sr = (x.clone().requires_grad_() for x in (q, k, v, base))
        ref, _ = reference_attention(qr, kr, vr, causal=True, sinks=sr)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        (ref * w).sum().backward()
        out = outs[-1]
        (out * usp_hal.shard(w, mesh=mesh)).sum().backward()
        dist.all_reduce(sinks.grad)       # each rank's share of the sink gradient, summed
        res["out"] = _err(out, usp_hal.shard(ref, mesh=mesh), torch.float64)
        res["dq"] = _err(ql.grad, usp_hal.shard(qr.grad, mesh=mesh), torch.float64)
        res["dsinks"] = _err(sinks.grad, sr.grad, torch.float64)
    return res


# ----------------------------------------------------------------------------- 7 + serving: decode
class _HostReads:
    """Counts reads of floating-point tensor data into Python (``.item()``, ``float()``,
    ``.tolist()``): on a GPU each is a device->host copy and a sync.  (The agreement's integer
    rows are host tensors of the CPU side group on a GPU mesh, so integer reads are not counted.)"""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self
        self.reads = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and args[0].is_floating_point():
                    counter.reads += 1
                return func(*args, **(kwargs or {}))
        self._mode = Mode()
        self._tolist = torch.Tensor.tolist

        def tolist(t):
            if t.is_floating_point():
                counter.reads += 1
            return counter._tolist(t)
        torch.Tensor.tolist = tolist
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


def decode_inputs_case(which: str, check_inputs: bool, layers: int = 2, steps: int = 3):
    """Rank 1's new ``which`` ("q", "k", "v" or "none") differs.  Returns per step the error
    text or the worst float64 error, and the host reads of tensor data over the steady steps."""
    from usp_hal.serving import ShardedKVCache
    mesh = get_mesh(1, 2)
    r = dist.get_rank()
    dt = torch.float64
    B, S0, Hq, Hkv, Dh = 2, 6, 4, 2, 8
    g = torch.Generator().manual_seed(11)
    K, V = torch.randn(B, S0, Hkv, Dh, generator=g, dtype=dt), torch.randn(B, S0, Hkv, Dh, generator=g, dtype=dt)
    cache = ShardedKVCache(mesh, num_layers=layers, batch_size=B, num_heads=Hq, num_kv_heads=Hkv, head_dim=Dh,
                           dtype=dt, block_size=2, attn_type="sdpa", check_inputs=check_inputs)
    for ly in range(layers):
        cache.load(ly, K, V, [S0, S0])
    ks, vs = [K.clone() for _ in range(layers)], [V.clone() for _ in range(layers)]
    out: list = []
    reads = []
    for step in range(steps):
        q = torch.randn(B, 1, Hq, Dh, generator=g, dtype=dt)
        k = torch.randn(B, 1, Hkv, Dh, generator=g, dtype=dt)
        v = torch.randn(B, 1, Hkv, Dh, generator=g, dtype=dt)
        bad = step == 1 and r == 1 and which != "none"
        mq, mk, mv = (x + 1 if bad and which == name else x for name, x in (("q", q), ("k", k), ("v", v)))
        for ly in range(layers):
            try:
                with _HostReads() as hr:
                    got = cache.decode(ly, mq, mk, mv, causal=True)
                reads.append(hr.reads)
            except Exception as exc:     # noqa: BLE001
                out.append(f"{type(exc).__name__}: {exc}")
                continue
            ks[ly] = torch.cat([ks[ly], k], 1)
            vs[ly] = torch.cat([vs[ly], v], 1)
            ref, _ = reference_attention(q, ks[ly], vs[ly], causal=True, key_offset=-(ks[ly].shape[1] - 1))
            out.append(_err(got, ref, dt))
    return {"steps": out, "reads": reads}


# ----------------------------------------------------------------------------- 9: re-initialised groups
def _resources():
    """Open file descriptors and threads (native ones too: gloo's) of this process."""
    import os
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def reinit_case(ports, cycles=8):
    """The pool's own group is destroyed; then ``cycles`` times: a new world group and mesh, a
    call of a module built in the first cycle, a destroy.  Returns the error a module gets on a
    destroyed group, the results of the calls, and file descriptors and threads per cycle."""
    import gc

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(4)
    ref = _ref(q, k, v, causal=True)
    dist.destroy_process_group()
    res = {"stale": None, "errs": [], "fds": [], "threads": [], "rebound": []}
    attn = usp_hal.LongContextAttention(attn_type="sdpa")
    ext = None
    for port in ports[:cycles]:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = usp_hal.init_sequence_parallel(1, world)
        if ext is None:
            ext = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)      # bound to this cycle's mesh
        elif res["stale"] is None:
            try:
                ext(*(usp_hal.shard(x, mesh=mesh) for x in (q, k, v)), causal=True)
            except Exception as exc:      # noqa: BLE001
                res["stale"] = f"{type(exc).__name__}: {exc}"
        out = attn(*(usp_hal.shard(x, mesh=mesh) for x in (q, k, v)), causal=True)   # the default mesh
        res["errs"].append(_err(out, usp_hal.shard(ref, mesh=mesh), torch.float64))
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
        fds, threads = _resources()
        res["fds"].append(fds)
        res["threads"].append(threads)
    return res


# ----------------------------------------------------------------------------- 1: errors before the agreement
class OddError(Exception):
    """An exception type of the caller's own."""


def bad_argument_case(what: str):
    """Rank 1 alone passes a bad argument (and catches the error); then both ranks call again
    with good inputs.  Returns the error text and class names, and the next call's float64 error."""
    import numpy as np
    mesh = get_mesh(1, 2)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    q, k, v = _inputs(5)
    ql, kl, vl = (usp_hal.shard(x, mesh=mesh) for x in (q, k, v))
    kw: dict = {"causal": True}
    if what == "odd_mask":      # a steady masked module first: the mask is evaluated before the agreement
        kw["mask"] = M.chunked_local(8)
        attn(ql, kl, vl, **kw)

    def odd_mod(b, h, q, kv):
        raise OddError("the caller's own failure")
    if dist.get_rank() == 1:
        if what == "list":
            ql = ql.tolist()
        elif what == "numpy":
            ql = np.asarray(ql)
        elif what == "mask_type":
            kw["mask"] = 42
        elif what == "odd_mask":
            kw["mask"] = odd_mod
        elif what == "window":
            kw["window_size"] = object()
    t0 = time.monotonic()
    try:
        attn(ql, kl, vl, **kw)
        err, kinds = None, []
    except Exception as exc:     # noqa: BLE001
        err, kinds = str(exc), [c.__name__ for c in type(exc).__mro__]
    return {"error": err, "kinds": kinds, "elapsed": time.monotonic() - t0, "after": _after(attn, mesh)}


def bad_packed_case():
    """Rank 1 alone passes a qkv of the wrong shape to the packed module; then a good call."""
    mesh = get_mesh(1, 2)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    packed = usp_hal.LongContextAttentionQKVPacked(attn_type="sdpa", mesh=mesh)
    q, k, v = _inputs(8)
    qkv = torch.stack([usp_hal.shard(x, mesh=mesh) for x in (q, k, v)], 2)
    if dist.get_rank() == 1:
        qkv = qkv[:, :, :2]
    try:
        packed(qkv, causal=True)
        err = None
    except Exception as exc:     # noqa: BLE001
        err = f"{type(exc).__name__}: {exc}"
    return {"error": err, "after": _after(attn, mesh)}
