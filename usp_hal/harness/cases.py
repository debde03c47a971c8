"""Run cases: one USP attention configuration on the ranks, checked and timed.

What ``usp-hal run`` and ``usp-hal bench`` execute.  Every rank builds random global inputs
from a fixed seed identically, shards them with :func:`usp_hal.shard` in the chosen layout,
runs :class:`usp_hal.LongContextAttention`, and checks the output (and, with ``bwd``, the
gradients) against single-device attention of the same global inputs; the timed
iterations record a per-rank breakdown (kernel, communication, merge, re-layout, the rest),
the bytes each rank sends and the peak memory growth (:mod:`usp_hal.harness.meter`).

Reference (``check``):
    ``fp64``  usp_hal.dispatch.reference.reference_attention in float64;
    ``sdpa``  torch scaled_dot_product_attention in float32 (float64 for fp64 inputs);
    ``auto``  fp64 while B*H*S^2 <= 2^25 (S <= 2048 at B=1, H=8), else sdpa.
Both run on blocks of query rows against the full keys (bounded memory); the row blocks
are divided among the ranks, the partial key/value gradients are summed over them, and
the distributed results are gathered with :func:`usp_hal.unshard` before comparing with
:func:`usp_hal.harness.verify.compare`.

Packed documents (``--cu-seqlens 0,300,1024`` or ``--docs N``): the global inputs are one
packed sequence with those document boundaries, sharded and attended with ``cu_seqlens``;
the reference attends within each document only (row blocks never cross a boundary).

The functions named ``rank_*`` and ``single_*`` run inside the ranks / the single-process
baseline worker (tasks of a :class:`~usp_hal.harness.pool.RankPool` or a
:class:`~usp_hal.harness.pool.TorchrunExecutor`); :func:`execute` drives one
configuration, ``usp-hal bench`` drives the same functions for a sweep.  ``rank_peer_*``
run yunchang's LongContextAttention on the same split for comparison.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from statistics import median
from types import SimpleNamespace
from typing import Any, Optional

from ..dispatch.backend import installed_version
from ..dispatch.capabilities import KernelCall, Package
from ..parallel.rotation import rotation_names
from ..sequence.blocks import balance
from ..sequence.positions import layout_names
from . import meter
from .pool import gather_objects
from .verify import compare

LAYOUTS = tuple(layout_names())
ROTATIONS = tuple(rotation_names())

DTYPES = ("fp32", "bf16", "fp16", "fp64")
FP8_CHOICES = ("none", "qvo", "qkvo")
PROJ_CHOICES = ("none", "sync", "overlap")
CHECKS = ("auto", "fp64", "sdpa", "none")
FP64_LIMIT = 1 << 25            # auto check: float64 reference while B*H*S^2 is at most this
FP64_BLOCK_BYTES = 64 << 20     # float64 reference: score block per query-row chunk
SDPA_BLOCK_BYTES = 256 << 20    # sdpa reference: score block (if the math path is taken)


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class RunConfig:
    """One USP configuration (picklable; what every rank receives)."""

    nproc: int = 2
    ulysses: int = 1
    ring: int = 2
    seqlen: int = 1024
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    causal: bool = True
    bwd: bool = True
    attn_type: str = "auto"
    ring_impl: str = "zigzag"
    rotate: str = "p2p"
    dtype: str = "fp32"
    iters: int = 5
    warmup: int = 1
    threads_per_rank: int = 1
    seed: int = 0
    check: str = "auto"
    device_type: str = "cpu"
    fp8: str = "none"            # Ulysses wire: none | qvo (q, v, out in fp8) | qkvo (k too)
    ring_fp8: bool = False       # the ring's V blocks (and K with qkvo) in fp8
    pipeline: int = 0            # >0: AsyncLongContextAttention with this many head groups
    low_memory: int = 0          # LongContextAttention(low_memory=...): 0 off, -1 the most groups, n groups
    proj: str = "none"           # none | sync (project, then attend) | overlap (async_qkv_attention)
    cu_seqlens: str = ""         # packed documents: "0,l1,l1+l2,...,S" ("" = one sequence)

    @property
    def split(self) -> str:
        return f"u{self.ulysses}r{self.ring}"

    def check_mode(self) -> str:
        if self.check != "auto":
            return self.check
        return "fp64" if self.batch * self.heads * self.seqlen ** 2 <= FP64_LIMIT else "sdpa"

    def input_key(self) -> tuple:
        return (self.seed, self.batch, self.seqlen, self.heads, self.kv_heads, self.head_dim, self.dtype,
                self.bwd, self.device_type, self.proj != "none")

    @property
    def lossy(self) -> bool:
        """The fp8 wire format: checked against an error budget, not the dtype's tolerance."""
        return self.fp8 != "none" or self.ring_fp8

    def documents(self):
        """The document boundaries as a tuple of ints, or None for one sequence."""
        if not self.cu_seqlens:
            return None
        from ..sequence.positions import as_cu_seqlens
        try:
            values = [int(x) for x in str(self.cu_seqlens).split(",")]
        except ValueError:
            raise ValueError(f"--cu-seqlens {self.cu_seqlens!r}: write the boundaries as integers, "
                             f"e.g. 0,300,1024") from None
        return as_cu_seqlens(values, self.seqlen)

    def module_kwargs(self) -> dict:
        return dict(ring_impl_type=self.ring_impl, attn_type=self.attn_type, rotation=self.rotate,
                    ulysses_float8=self.fp8 != "none", float8_key=self.fp8 == "qkvo", ring_float8=self.ring_fp8)


def resolve_split(nproc: Optional[int], ulysses: Optional[int], ring: Optional[int]):
    """(nproc, ulysses, ring) from what was given; ValueError naming the fix otherwise."""
    for name, val in (("--nproc", nproc), ("--ulysses", ulysses), ("--ring", ring)):
        if val is not None and val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if nproc is None:
        nproc = (ulysses or 1) * (ring or 1) if (ulysses or ring) else 2
    if ulysses is None and ring is None:
        ulysses, ring = 1, nproc
    elif ulysses is None:
        assert ring is not None
        if nproc % ring:
            raise ValueError(f"--ring {ring} does not divide --nproc {nproc}; pick a ring degree that divides "
                             f"the number of ranks (or pass --ulysses too)")
        ulysses = nproc // ring
    elif ring is None:
        if nproc % ulysses:
            raise ValueError(f"--ulysses {ulysses} does not divide --nproc {nproc}; pick a Ulysses degree that "
                             f"divides the number of ranks (or pass --ring too)")
        ring = nproc // ulysses
    assert ulysses is not None and ring is not None
    if ulysses * ring != nproc:
        raise ValueError(f"--ulysses {ulysses} x --ring {ring} = {ulysses * ring} ranks, but --nproc is {nproc}; "
                         f"the sequence-parallel group spans every rank, so use --nproc {ulysses * ring} or "
                         f"degrees whose product is {nproc}")
    return nproc, ulysses, ring


def validate(cfg: RunConfig) -> None:
    """Checks that need no process (the core validates the rest on every rank)."""
    if cfg.seqlen < 1 or cfg.batch < 1 or cfg.head_dim < 1 or cfg.heads < 1 or cfg.kv_heads < 1:
        raise ValueError("--seqlen, --batch, --heads, --kv-heads and --head-dim must be >= 1")
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"--heads {cfg.heads} is not a multiple of --kv-heads {cfg.kv_heads}; "
                         "each key/value head must serve the same number of query heads")
    if cfg.iters < 1 or cfg.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    if cfg.threads_per_rank < 1:
        raise ValueError("--threads-per-rank must be >= 1")
    if cfg.pipeline < 0:
        raise ValueError("--pipeline must be >= 0")
    if cfg.low_memory < -1 or (cfg.low_memory and cfg.pipeline):
        raise ValueError("--low-memory takes a number of head groups (or none: as many as the heads allow) and "
                         "cannot be combined with --pipeline (which keeps the groups in flight together)")
    if cfg.fp8 != "none" and cfg.ulysses == 1 and not cfg.ring_fp8:
        raise ValueError(f"--fp8 {cfg.fp8} sets the Ulysses all-to-all's wire format, and a ring-only split (ulysses "
                         "1) has no all-to-all to apply it to; add --ring-fp8 for the ring's blocks in fp8, or use "
                         "--ulysses 2 or more")
    if cfg.ring_fp8 and cfg.ring == 1:
        raise ValueError(f"--ring-fp8 sets the ring's wire format, and this split (ulysses {cfg.ulysses} x ring 1) "
                         "has no ring; use --fp8 qvo/qkvo for the Ulysses all-to-all, or --ring 2 or more")
    if cfg.seqlen < cfg.nproc:
        raise ValueError(f"--seqlen {cfg.seqlen} is shorter than the number of ranks ({cfg.nproc}); "
                         "every rank needs at least one token")
    if cfg.cu_seqlens:
        try:
            cfg.documents()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--cu-seqlens: {exc}") from None
    if cfg.device_type != "cpu":
        from ..dispatch import platform as _platform
        n = _platform.device_count(cfg.device_type)
        if cfg.nproc > n:
            raise ValueError(f"{cfg.nproc} ranks need {cfg.nproc} {cfg.device_type} devices, found {n}; "
                             "use --nproc <= the device count, or --device cpu")


# ----------------------------------------------------------------------------- comm minimum
def _needed_kv_heads(heads: int, kv_heads: int, ulysses: int) -> int:
    """Sum over Ulysses ranks of the distinct key/value heads its query heads use."""
    g = heads // kv_heads
    base, extra = divmod(heads, ulysses)
    total, start = 0, 0
    for u in range(ulysses):
        n = base + (1 if u < extra else 0)
        total += len({h // g for h in range(start, start + n)})
        start += n
    return total


def min_comm_bytes(cfg: RunConfig) -> dict:
    """Theoretical minimum bytes one rank sends per iteration (average over ranks).

    With N = U*R ranks, n = S/N local tokens, t = B*n*D, e = element size, e_acc = size
    of the gradient accumulation dtype (fp32, fp64 for fp64 inputs), K = sum over Ulysses
    ranks of the key/value heads each one needs (= Hkv when U divides Hkv):

        forward   Ulysses  (U-1)/U * t*e * (2H + 2K)        q and out, k and v
                  ring     (R-1) * 2*t*e*K                 R-1 K/V blocks pass by
        backward  Ulysses  (U-1)/U * t*e * (2H + 2K)        dout and dq, dk and dv
                  ring     (R-1) * 2*t*(e + e_acc)*K       K/V again, dK/dV home
    """
    e = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}[cfg.dtype]
    e_acc = 8 if cfg.dtype == "fp64" else 4
    U, R, N = cfg.ulysses, cfg.ring, cfg.nproc
    t = cfg.batch * cfg.seqlen / N * cfg.head_dim
    K = _needed_kv_heads(cfg.heads, cfg.kv_heads, U)
    uly = (U - 1) / U * t * e * (2 * cfg.heads + 2 * K)
    fwd = uly + (R - 1) * 2 * t * e * K
    bwd = uly + (R - 1) * 2 * t * (e + e_acc) * K
    return {"fwd": fwd, "bwd": bwd if cfg.bwd else 0.0, "total": fwd + (bwd if cfg.bwd else 0.0)}


# ----------------------------------------------------------------------------- rank side
_MESHES: dict = {}
_INPUTS: dict = {}
_CASES: dict = {}
_REFS: dict = {}


def _torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[name]


def _device(device_type: str):
    import torch

    from ..dispatch import platform as _platform
    if device_type == "cpu":
        return torch.device("cpu")
    idx = 0
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        try:
            idx = acc.current_device_index()
        except Exception:
            idx = 0
    return torch.device(_platform.torch_device_name(device_type), idx)


def _sync(device_type: str) -> None:
    from ..dispatch import platform as _platform
    _platform.synchronize(device_type)


def _mesh(U: int, R: int):
    import usp_hal
    if (U, R) not in _MESHES:
        _MESHES[(U, R)] = usp_hal.init_sequence_parallel(U, R, set_default=False)
    return _MESHES[(U, R)]


def global_inputs(cfg: RunConfig):
    """(q, k, v, dout or None): [B, S, H|Hkv, D] from ``cfg.seed``, the same in every process."""
    import torch
    key = cfg.input_key()
    if key not in _INPUTS:
        _INPUTS.clear()
        g = torch.Generator().manual_seed(cfg.seed)
        dt, dev = _torch_dtype(cfg.dtype), _device(cfg.device_type)
        shape_q = (cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
        shape_kv = (cfg.batch, cfg.seqlen, cfg.kv_heads, cfg.head_dim)
        if cfg.proj != "none":    # q, k, v = hidden @ W^T (what the ranks compute from their hidden part)
            hidden, weights = projection_inputs(cfg)
            with torch.no_grad():
                q, k, v = (torch.nn.functional.linear(hidden, w).view(cfg.batch, cfg.seqlen, h, cfg.head_dim)
                           for w, h in zip(weights, (cfg.heads, cfg.kv_heads, cfg.kv_heads)))
            g.manual_seed(cfg.seed + 1)
        else:
            q = torch.randn(shape_q, generator=g).to(dt).to(dev)
            k = torch.randn(shape_kv, generator=g).to(dt).to(dev)
            v = torch.randn(shape_kv, generator=g).to(dt).to(dev)
        dout = torch.randn(shape_q, generator=g).to(dt).to(dev) if cfg.bwd else None
        _INPUTS[key] = (q, k, v, dout)
    return _INPUTS[key]


def projection_inputs(cfg: RunConfig):
    """(hidden [B, S, E], (W_q, W_k, W_v)) for ``--proj``: E = heads * head_dim, weights
    scaled so q, k, v have unit variance."""
    import torch
    g = torch.Generator().manual_seed(cfg.seed + 7)
    dt, dev = _torch_dtype(cfg.dtype), _device(cfg.device_type)
    e = cfg.heads * cfg.head_dim
    hidden = torch.randn(cfg.batch, cfg.seqlen, e, generator=g).to(dt).to(dev)
    weights = tuple((torch.randn(h * cfg.head_dim, e, generator=g) / math.sqrt(e)).to(dt).to(dev)
                    for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
    return hidden, weights


class _Case(SimpleNamespace):
    """One case's state inside a rank (inputs, module, timers), by attribute."""


def rank_prepare(cfg: Any, case: str) -> dict:
    """Shard the inputs, run the first call (the one that is checked), and prepare the
    timers.  Keeps the state under ``case`` for rank_steps/rank_check."""
    import torch.distributed as dist

    import usp_hal
    cfg = RunConfig(**cfg)
    mesh = _mesh(cfg.ulysses, cfg.ring)
    q, k, v, dout = global_inputs(cfg)
    st = _Case()
    st.cfg, st.mesh = cfg, mesh

    cu = cfg.documents()

    def sh(x):
        return usp_hal.shard(x, layout=cfg.ring_impl, mesh=mesh, seq_dim=1, cu_seqlens=cu).contiguous()

    st.q, st.k, st.v = (sh(x).requires_grad_(cfg.bwd) for x in (q, k, v))
    st.dout = sh(dout) if cfg.bwd else None
    if cfg.pipeline:
        st.attn = usp_hal.AsyncLongContextAttention(mesh=mesh, head_chunks=cfg.pipeline, **cfg.module_kwargs())
    else:
        st.attn = usp_hal.LongContextAttention(mesh=mesh, low_memory=True if cfg.low_memory < 0 else cfg.low_memory,
                                               **cfg.module_kwargs())
    st.leaves = [st.q, st.k, st.v]
    st.call = lambda: st.attn(st.q, st.k, st.v, causal=cfg.causal, cu_seqlens=cu)
    if cfg.proj != "none":
        _projection_call(st, cfg, sh)
    out = st.call()
    if cfg.bwd:
        out.backward(st.dout)
    _sync(cfg.device_type)
    st.result = {"out": out.detach()}
    if cfg.bwd and cfg.proj == "none":
        st.result.update(dq=st.q.grad, dk=st.k.grad, dv=st.v.grad)
    for t in st.leaves:
        t.grad = None
    del out
    backend = st.attn.last_backend
    st.ktimes = meter.KernelTimes()
    sync = None if cfg.device_type == "cpu" else (lambda: _sync(cfg.device_type))
    meter.time_backend(backend, st.ktimes, sync)
    meter.instrument_core()
    st.comm = meter.CommMeter()
    st.mem = meter.MemoryMeter(cfg.device_type)
    _CASES[case] = st
    inputs = sum(t.numel() * t.element_size() for t in (st.q, st.k, st.v, st.dout) if t is not None)
    return {"rank": dist.get_rank(), "backend": getattr(backend, "NAME", type(backend).__name__),
            "input_bytes": inputs,
            "local_len": int(st.q.shape[1]),
            "ring_rank": mesh.ring_rank, "ulysses_rank": mesh.ulysses_rank}


def _projection_call(st, cfg: RunConfig, sh) -> None:
    """``--proj``: the timed call projects q, k, v from this rank's hidden states first
    (``sync``), or overlaps each projection with the previous tensor's all-to-all
    (``overlap``, usp_hal.async_qkv_attention).  Only the output is checked."""
    import torch

    import usp_hal
    hidden, weights = projection_inputs(cfg)
    st.hidden = sh(hidden).requires_grad_(cfg.bwd)
    st.weights = [w.clone().requires_grad_(cfg.bwd) for w in weights]
    st.leaves = [st.hidden] + st.weights
    heads = (cfg.heads, cfg.kv_heads, cfg.kv_heads)
    cu = cfg.documents()
    projs = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in st.weights]

    def sync_call():
        q, k, v = (p(st.hidden).view(cfg.batch, st.hidden.shape[1], h, cfg.head_dim) for p, h in zip(projs, heads))
        return st.attn(q, k, v, causal=cfg.causal, cu_seqlens=cu)

    def overlap_call():
        return usp_hal.async_qkv_attention(st.attn, st.hidden, *projs, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                           head_dim=cfg.head_dim, causal=cfg.causal, cu_seqlens=cu)
    st.call = overlap_call if cfg.proj == "overlap" else sync_call


def rank_steps(case: str, n: int, memory: bool = False) -> list:
    """``n`` timed iterations; one record per iteration.  ``memory``: measure each
    iteration's peak memory growth instead (its timing then includes page faults)."""
    import torch.distributed as dist
    st = _CASES[case]
    cfg = st.cfg
    recs = []
    meter.ACTIVE["times"] = st.ktimes
    with st.comm:
        for _ in range(n):
            for t in st.leaves:
                t.grad = None
            dist.barrier(group=st.mesh.sp_group)
            _sync(cfg.device_type)
            st.ktimes.reset()
            st.comm.reset()
            if memory:
                st.mem.start()
            t0 = time.perf_counter()
            out = st.call()
            _sync(cfg.device_type)
            t1 = time.perf_counter()
            if cfg.bwd:
                out.backward(st.dout)
                _sync(cfg.device_type)
            t2 = time.perf_counter()
            mem = st.mem.stop() if memory else None
            del out
            recs.append({"time": t2 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "kernel_fwd": st.ktimes.fwd_s,
                         "kernel_bwd": st.ktimes.bwd_s, "kernel_calls": st.ktimes.fwd_calls + st.ktimes.bwd_calls,
                         "comm": st.comm.seconds, "bytes": dict(st.comm.bytes), "calls": dict(st.comm.calls),
                         "metadata_bytes": st.comm.metadata_bytes, "merge": st.ktimes.merge_s,
                         "work": st.ktimes.work,
                         "layout": st.ktimes.layout_s,
                         "mem": mem})
    meter.ACTIVE["times"] = None
    return recs


def _row_blocks(lo: int, hi: int, rows_per_block: int):
    a = lo
    while a < hi:
        b = min(hi, a + rows_per_block)
        yield a, b
        a = b


def _reference_rows(cfg: RunConfig, mode: str, lo: int, hi: int):
    """Reference out rows [lo, hi) and their gradients (dq rows, partial dk/dv over all keys)."""
    import torch
    import torch.nn.functional as F

    from ..dispatch.reference import reference_attention
    q, k, v, dout = global_inputs(cfg)
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    cdt = torch.float64 if (mode == "fp64" or cfg.dtype == "fp64") else torch.float32
    per_row = B * H * S * (8 if cdt == torch.float64 else 4)
    limit = FP64_BLOCK_BYTES if mode == "fp64" else SDPA_BLOCK_BYTES
    rows = max(1, limit // per_row)
    out = torch.empty(B, hi - lo, H, D, dtype=cdt, device=q.device)
    dq: Any = torch.empty_like(out) if cfg.bwd else None
    dk: Any = torch.zeros(B, S, Hkv, D, dtype=cdt, device=q.device) if cfg.bwd else None
    dv: Any = torch.zeros_like(dk) if cfg.bwd else None
    cu = cfg.documents() or (0, S)
    # row blocks inside one document each; a query sees the keys of its document from k0
    blocks = [(a, b, k0, e) for k0, e in zip(cu, cu[1:]) if max(lo, k0) < min(hi, e)
              for a, b in _row_blocks(max(lo, k0), min(hi, e), rows)]
    for a, b, k0, e in blocks:
        kend = b if cfg.causal else e
        with torch.enable_grad():
            qc = q[:, a:b].to(cdt).requires_grad_(cfg.bwd)
            kc = k[:, k0:kend].to(cdt).requires_grad_(cfg.bwd)
            vc = v[:, k0:kend].to(cdt).requires_grad_(cfg.bwd)
            if mode == "fp64":
                o, _ = reference_attention(qc, kc, vc, softmax_scale=scale, causal=cfg.causal, key_offset=k0 - a)
            else:
                mask = None
                if cfg.causal:   # query a+m sees keys n <= a+m
                    m = torch.arange(a, b, device=q.device).unsqueeze(1)
                    mask = torch.arange(k0, kend, device=q.device).unsqueeze(0) <= m
                kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
                if Hkv != H:
                    kt, vt = kt.repeat_interleave(H // Hkv, 1), vt.repeat_interleave(H // Hkv, 1)
                o = F.scaled_dot_product_attention(qc.transpose(1, 2), kt, vt, attn_mask=mask,
                                                   scale=scale).transpose(1, 2)
            out[:, a - lo:b - lo] = o.detach()
            if cfg.bwd:
                gq, gk, gv = torch.autograd.grad(o, (qc, kc, vc), dout[:, a:b].to(cdt))
                dq[:, a - lo:b - lo] = gq
                dk[:, k0:kend] += gk
                dv[:, k0:kend] += gv
    return out, dq, dk, dv


def reference_tolerance(cfg: RunConfig, mode: str) -> tuple:
    """(atol, rtol) for this check: the dtype's tolerance against float64; against a float32
    reference (which carries its own rounding of the same size) twice that."""
    from ..dispatch.reference import tolerance
    atol, rtol = tolerance(_torch_dtype(cfg.dtype))
    if mode == "sdpa" and cfg.dtype != "fp64":
        atol, rtol = 2 * atol, 2 * rtol
    return atol, rtol


def rank_check(case: str) -> dict:
    """Compare this case's first-call results with the reference (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import usp_hal
    st = _CASES[case]
    cfg, mesh = st.cfg, st.mesh
    mode = cfg.check_mode()
    if mode == "none":
        return {"mode": "none", "errors": {}}
    cu = cfg.documents()
    full = {name: usp_hal.unshard(t, layout=cfg.ring_impl, mesh=mesh, seq_dim=1, cu_seqlens=cu)
            for name, t in st.result.items()}
    rkey = (cfg.input_key(), cfg.causal, mode, cu)
    if rkey not in _REFS:
        _REFS.clear()
        bounds = torch.tensor_split(torch.arange(cfg.seqlen), mesh.sp_size)[mesh.sp_rank]
        lo, hi = (int(bounds[0]), int(bounds[-1]) + 1) if bounds.numel() else (0, 0)
        out, dq, dk, dv = _reference_rows(cfg, mode, lo, hi)
        if cfg.bwd:
            for t in (dk, dv):
                dist.all_reduce(t, group=mesh.sp_group)
        _REFS[rkey] = (lo, hi, out, dq, dk, dv)
    lo, hi, out, dq, dk, dv = _REFS[rkey]
    atol, rtol = reference_tolerance(cfg, mode)
    lossy = cfg.lossy
    errors = {"out": compare(full["out"][:, lo:hi], out, atol, rtol, lossy)}
    if cfg.bwd and "dq" in full:
        errors["dq"] = compare(full["dq"][:, lo:hi], dq, atol, rtol, lossy)
        errors["dk"] = compare(full["dk"], dk, atol, rtol, lossy)
        errors["dv"] = compare(full["dv"], dv, atol, rtol, lossy)
    return {"mode": mode, "errors": errors, "tolerance": [atol, rtol], "lossy": lossy}


def rank_mem_method(case: str) -> str:
    return _CASES[case].mem.method


def rank_release(case: str) -> None:
    _CASES.pop(case, None)


def rank_clear() -> None:
    """Drop every cached input, reference and case (between sweep groups)."""
    _CASES.clear()
    _INPUTS.clear()
    _REFS.clear()


# ----------------------------------------------------------------------------- single process
def single_prepare(cfg: Any, case: str) -> dict:
    """The backend the distributed run uses, called directly on the full sequence in one
    process: the baseline every configuration is compared with."""
    from ..dispatch.capabilities import AttnRequest, KernelCall
    from ..dispatch.registry import REGISTRY
    cfg = RunConfig(**cfg)
    q, k, v, dout = global_inputs(cfg)
    call = KernelCall(scale=1.0 / math.sqrt(cfg.head_dim), causal=cfg.causal, needs_grad=cfg.bwd, needs_lse=cfg.bwd)
    req = AttnRequest.of(q, k, v, call, lengths=False, device_type=cfg.device_type)
    st = _Case()
    st.call = call
    st.cfg = cfg
    st.backend = REGISTRY.instance(cfg.attn_type, req)
    st.mem = meter.MemoryMeter(cfg.device_type)
    _CASES[case] = st
    return {"backend": st.backend.NAME,
            "input_bytes": sum(t.numel() * t.element_size() for t in (q, k, v, dout) if t is not None)}


def single_steps(case: str, n: int, threads: int, memory: bool = False) -> list:
    import torch
    st = _CASES[case]
    cfg = st.cfg
    torch.set_num_threads(threads)
    q, k, v, dout = global_inputs(cfg)
    recs = []
    for _ in range(n):
        _sync(cfg.device_type)
        if memory:
            st.mem.start()
        t0 = time.perf_counter()
        out, lse = st.backend.forward(q, k, v, st.call)
        _sync(cfg.device_type)
        t1 = time.perf_counter()
        if cfg.bwd:
            st.backend.backward(dout, q, k, v, out, lse, st.call)
            _sync(cfg.device_type)
        t2 = time.perf_counter()
        del out, lse
        recs.append({"time": t2 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "mem": st.mem.stop() if memory else None})
    return recs


# ----------------------------------------------------------------------------- summaries
def summarize(cfg: RunConfig, per_rank_iters: list, per_rank_mem: list) -> dict:
    """Per-iteration max over ranks -> median; per-rank medians of each part.
    ``per_rank_mem``: each rank's records of the memory iteration(s)."""
    iters = list(zip(*per_rank_iters))          # iteration -> records of every rank
    it_max = [max(r["time"] for r in recs) for recs in iters]
    fwd_max = [max(r["fwd"] for r in recs) for recs in iters]
    bwd_max = [max(r["bwd"] for r in recs) for recs in iters]
    ranks = []
    for rank, recs in enumerate(per_rank_iters):
        total = median([r["time"] for r in recs])
        kf = median([r["kernel_fwd"] for r in recs])
        kb = median([r["kernel_bwd"] for r in recs])
        comm = median([r["comm"] for r in recs])
        merge = median([r["merge"] for r in recs])
        layout = median([r["layout"] for r in recs])
        other = median([r["time"] - r["kernel_fwd"] - r["kernel_bwd"] - r["comm"] - r["merge"] - r["layout"]
                        for r in recs])
        ranks.append({"rank": rank, "time": total, "kernel_fwd": kf, "kernel_bwd": kb, "comm": comm,
                      "merge": merge, "layout": layout, "other": other,
                      "bytes": recs[-1]["bytes"], "calls": recs[-1]["calls"], "work": recs[-1]["work"],
                      "metadata_bytes": recs[-1]["metadata_bytes"],
                      "sent": sum(recs[-1]["bytes"].values()),
                      "mem": max(r["mem"] for r in per_rank_mem[rank])})
    kernel = [r["kernel_fwd"] + r["kernel_bwd"] for r in ranks]
    work = [r["work"] for r in ranks]
    return {"time": median(it_max), "fwd": median(fwd_max), "bwd": median(bwd_max), "iter_times": it_max,
            "work_balance": balance(work),
            "ranks": ranks, "kernel_balance": balance(kernel),
            "sent_per_rank": max(r["sent"] for r in ranks), "mem_per_rank": max(r["mem"] for r in ranks)}


def merge_checks(checks: list) -> dict:
    mode = checks[0]["mode"]
    errors: Any = {}
    for c in checks:
        for name, e in c["errors"].items():
            cur = errors.get(name)
            if cur is None or (e["worst"] > cur["worst"]):
                errors[name] = e
    ok = all(e["worst"] <= 1.0 for e in errors.values())
    return {"mode": mode, "errors": errors, "tolerance": checks[0].get("tolerance"), "ok": ok,
            "lossy": checks[0].get("lossy", False)}


def execute(cfg: RunConfig, executor, timeout: float) -> dict:
    """prepare, warm up, time, check on ``executor`` (a RankPool or TorchrunExecutor)."""
    t_end = time.monotonic() + timeout

    def left():
        return max(1.0, t_end - time.monotonic())

    prep = executor.run(rank_prepare, timeout=left(), cfg=asdict(cfg), case="run")
    if cfg.warmup:
        executor.run(rank_steps, timeout=left(), case="run", n=cfg.warmup)
    recs = executor.run(rank_steps, timeout=left(), case="run", n=cfg.iters)
    mem = executor.run(rank_steps, timeout=left(), case="run", n=1, memory=True)
    mem_method = executor.run(rank_mem_method, timeout=left(), case="run")[0]
    check = merge_checks(executor.run(rank_check, timeout=left(), case="run"))
    executor.run(rank_release, timeout=left(), case="run")
    summary = summarize(cfg, recs, mem)
    # what one process needs for the whole sequence with the same kernel, measured the same way
    # (every rank measures it at once; rank 0's figure is reported)
    executor.run(single_prepare, timeout=left(), cfg=asdict(cfg), case="one")
    one = executor.run(single_steps, timeout=left(), case="one", n=1, threads=cfg.threads_per_rank, memory=True)
    executor.run(rank_release, timeout=left(), case="one")
    summary["mem_one_process"] = one[0][0]["mem"]
    return {"mem_method": mem_method, "config": asdict(cfg), "backend": prep[0]["backend"], "prepare": prep,
            "check": check,
            "summary": summary, "min_comm": min_comm_bytes(cfg),
            "input_bytes_per_rank": max(p["input_bytes"] for p in prep)}


# ----------------------------------------------------------------------------- peers
# yunchang (0.6.4) is given the kernel usp-hal runs wherever yunchang can take it:
#
# * CPU: yunchang has no CPU kernel with a log-sum-exp (its TORCH_MATH forward returns a zero
#   lse, so its ring merges wrongly; TORCH_FLASH/TORCH_EFFICIENT call CUDA-only aten ops).  Its
#   ``attn_processor=`` hook is used instead: ``select_flash_attn_impl`` returns the processor
#   when ``attn_type`` is none of its AttnType members, and the basic ring calls it as
#   ``fn(q, k, v, <flash-attn's keywords>, return_softmax=)`` (the keywords of
#   ``KernelCall.flash_kwargs``) with q, k, v as [B, S, H, D], expecting ``(out [B, S, H, D], lse [B, H, S])``
#   (its merge transposes lse to [B, S, H, 1] and keeps the first block's out in float32).
#   Only the basic ring passes ``attn_processor`` on; its zigzag and stripe rings do not (they
#   have no same-kernel path on CPU and are skipped with that reason), and its backward never
#   takes the processor (forward only).
# * GPU: the same kernel by name: FA / FA3 for usp-hal's fa2 / fa3 backends, TORCH_FLASH /
#   TORCH_EFFICIENT (the aten ops usp-hal's sdpa backend calls) for sdpa; any other usp-hal
#   backend is compared with yunchang's FA and the row says the kernels differ.
CPU_PEER_KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"


def peer_available(name: str):
    """(available, note)."""
    import importlib.util
    if name == "yunchang":
        if importlib.util.find_spec("yunchang") is None:
            return False, "yunchang is not installed (pip install yunchang==0.6.4 --no-deps to compare)"
        return True, ""
    return False, f"unknown peer {name!r}"


_PEER: Any = {}


def _is_default(value, default) -> bool:
    if value is None or default is None:
        return value is default
    return (tuple(value) if isinstance(default, tuple) else value) == default


def yunchang_cpu_processor(q, k, v, softmax_scale=None, causal=False, return_softmax=False, **options):
    """The ``attn_processor`` yunchang gets on CPU: usp-hal's CPU kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``) on q, k, v of [B, S, H, D], returning
    ``(out [B, S, H, D], lse [B, H, S] float32, natural log)``, the pair yunchang's ring
    merges.  yunchang's other keywords (``options``: flash-attn's, as
    :meth:`usp_hal.dispatch.capabilities.KernelCall.flash_kwargs` names them) are what the bench
    never asks for: a value other than flash-attn's default is refused, naming the option."""
    import torch
    defaults = KernelCall().flash_kwargs()
    asked = [name for name, value in options.items() if name in defaults and not _is_default(value, defaults[name])]
    if asked:
        raise ValueError(f"the bench's yunchang processor takes plain attention only, not {', '.join(asked)}: "
                         "the bench's peer comparison asks for the scale and causal alone")
    # the CPU op reads the head dim as contiguous whatever its stride: make it so (a no-op here)
    qt, kt, vt = (x.transpose(1, 2) if x.stride(-1) == 1 else x.contiguous().transpose(1, 2) for x in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, bool(causal),
                                                                          scale=softmax_scale)
    return out.transpose(1, 2), lse


def usp_hal_kernel_label(backend: str, device_type: str, dtype: str) -> str:
    """The kernel usp-hal's ``backend`` runs for plain (unmasked) attention in ``dtype``."""
    if backend == "sdpa":
        if device_type == "cpu":
            return CPU_PEER_KERNEL
        return ("aten._scaled_dot_product_flash_attention" if dtype in ("bf16", "fp16")
                else "aten._scaled_dot_product_efficient_attention")
    return {"fa2": "FA2 (FlashAttention-2)", "fa3": "FA3 (FlashAttention-3)"}.get(backend, backend)


def yunchang_kernel(device_type: str, usp_backend: str, dtype: str, ring_impl: str) -> dict:
    """How yunchang is called for a fair comparison with usp-hal's ``usp_backend``:
    {"attn_type", "attn_processor", "kernel" (a label), "same_kernel", "skip" (a reason or None)}."""
    from yunchang.kernels import AttnType
    if device_type == "cpu":
        if ring_impl != "basic":
            return {"attn_type": None, "attn_processor": None, "kernel": "-", "same_kernel": False,
                    "skip": f"yunchang's {ring_impl} ring does not pass attn_processor to its kernel and it has no "
                            f"CPU kernel with an lse: no same-kernel comparison (use --ring-impls basic)"}
        return {"attn_type": None, "attn_processor": yunchang_cpu_processor,
                "kernel": f"{CPU_PEER_KERNEL} (attn_processor)", "same_kernel": usp_backend == "sdpa",
                "skip": None}
    if usp_backend in ("fa2", "fa3", "sdpa"):
        if usp_backend == "sdpa":
            t = AttnType.TORCH_FLASH if dtype in ("bf16", "fp16") else AttnType.TORCH_EFFICIENT
        else:
            t = AttnType.FA if usp_backend == "fa2" else AttnType.FA3
        return {"attn_type": t, "attn_processor": None,
                "kernel": f"{usp_hal_kernel_label(usp_backend, device_type, dtype)} (AttnType.{t.name})",
                "same_kernel": True, "skip": None}
    from usp_hal.dispatch.registry import get_backend
    t = AttnType.FA if get_backend("fa2").availability().ok else AttnType.TORCH_EFFICIENT
    return {"attn_type": t, "attn_processor": None, "kernel": f"AttnType.{t.name}", "same_kernel": False,
            "skip": None}


def rank_peer_prepare(cfg: Any, case: str, usp_backend: str = "sdpa") -> dict:
    """yunchang's LongContextAttention on this split, given the kernel usp-hal's
    ``usp_backend`` runs (:func:`yunchang_kernel`); its first call's error against the
    reference rows this rank computes for the same inputs (forward only)."""
    import torch
    import torch.distributed as dist
    import yunchang
    from yunchang import EXTRACT_FUNC_DICT, LongContextAttention, set_seq_parallel_pg

    cfg = RunConfig(**cfg)
    kern = yunchang_kernel(cfg.device_type, usp_backend, cfg.dtype, cfg.ring_impl)
    if kern["skip"]:
        return {"skipped": kern["skip"]}
    rank, world = dist.get_rank(), dist.get_world_size()
    if _PEER.get("degrees") != (cfg.ulysses, cfg.ring):
        set_seq_parallel_pg(cfg.ulysses, cfg.ring, rank, world)
        _PEER["degrees"] = (cfg.ulysses, cfg.ring)
    impl = {"basic": "basic", "zigzag": "zigzag", "stripe": "strip"}[cfg.ring_impl]
    q, k, v, _ = global_inputs(cfg)

    def ext(x):
        return EXTRACT_FUNC_DICT[impl](x, rank, world, cfg.ring, cfg.ulysses).contiguous()

    st = _Case()
    try:
        st.q, st.k, st.v = ext(q), ext(k), ext(v)
        st.attn = LongContextAttention(ring_impl_type=impl, attn_type=kern["attn_type"],
                                       attn_processor=kern["attn_processor"])
        st.cfg = cfg
        out = st.attn(st.q, st.k, st.v, causal=cfg.causal)     # inputs need no grad, as usp-hal's forward
    except Exception as exc:     # the peer's own failure is a result, not a crash of the sweep
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    # reference: this rank's rows, gathered, then laid out the way yunchang lays them out
    mode = cfg.check_mode() if cfg.check != "none" else None
    err = None
    if mode:
        bounds = torch.tensor_split(torch.arange(cfg.seqlen), world)[rank]
        lo, hi = int(bounds[0]), int(bounds[-1]) + 1
        ref_rows = _reference_rows(replace(cfg, bwd=False), mode, lo, hi)[0].to(q.dtype).contiguous()
        parts = gather_objects(ref_rows.cpu())
        ref = torch.cat(parts, dim=1).to(q.device)
        atol, rtol = reference_tolerance(cfg, mode)
        err = compare(out, ext(ref), atol, rtol)
    st.mem = meter.MemoryMeter(cfg.device_type)
    _CASES[case] = st
    version = getattr(yunchang, "__version__", None) or installed_version(Package("yunchang", "yunchang"))
    return {"version": version, "error": err, "check_mode": mode, "attn_type": kern["kernel"],
            "kernel": kern["kernel"], "same_kernel": kern["same_kernel"],
            "usp_hal_kernel": usp_hal_kernel_label(usp_backend, cfg.device_type, cfg.dtype)}


def rank_peer_steps(case: str, n: int, memory: bool = False, run: bool = False) -> list:
    """``n`` timed forward calls of the peer, each after a barrier (as rank_steps); ``run``:
    one barrier, then the ``n`` calls back to back, one record of the mean call."""
    st = _CASES[case]
    return _bare_calls(st, lambda: st.attn(st.q, st.k, st.v, causal=st.cfg.causal), n, memory, run)


def rank_plain_steps(case: str, n: int, run: bool = False) -> list:
    """``n`` timed forward calls of usp-hal's ``case`` (prepared by rank_prepare) with no
    meter at work: no collective wrapped, no step hook, the backend's own methods instead
    of its timers, so the call takes the path a user's call takes (a plan's bound fast path
    where it has one: the hook and the timers each turn that off).  The usp-hal side of the
    peer comparison, as bare as the peer's own calls (:func:`rank_peer_steps`, ``run`` as
    there); the breakdown comes from rank_steps."""
    st = _CASES[case]
    meter.uninstrument_core()
    try:
        with meter.untimed(st.attn.last_backend):
            recs = _bare_calls(st, st.call, n, False, run)
    finally:
        meter.instrument_core()
    return recs


def _bare_calls(st, call, n: int, memory: bool, run: bool = False) -> list:
    """Records of ``n`` calls, each timed after a barrier; ``run``: the calls back to back
    after one barrier, as a model makes them (the ranks' skew at a barrier's exit then counts
    once, not per call), and one record of the mean call."""
    import torch.distributed as dist
    if run:
        dist.barrier()
        _sync(st.cfg.device_type)
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
            del out
        _sync(st.cfg.device_type)
        return [{"time": (time.perf_counter() - t0) / n, "mem": None}]
    recs = []
    for _ in range(n):
        dist.barrier()
        _sync(st.cfg.device_type)
        if memory:
            st.mem.start()
        t0 = time.perf_counter()
        out = call()
        _sync(st.cfg.device_type)
        t = time.perf_counter() - t0
        del out
        recs.append({"time": t, "mem": st.mem.stop() if memory else None})
    return recs
