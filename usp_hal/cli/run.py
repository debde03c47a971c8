"""``usp-hal run``: one USP attention configuration on N ranks, checked and timed.

Spawns N ranks on this machine (or, under ``torchrun``, runs as one of its ranks), builds
random global inputs from a fixed seed identically on every rank, shards them with
:func:`usp_hal.shard` in the chosen layout, runs :class:`usp_hal.LongContextAttention`,
checks the output (and, with ``--bwd``, the gradients) against single-device attention of
the same global inputs, and reports the time per iteration, a per-rank breakdown (kernel,
communication, the rest), the bytes each rank sends against the minimum for the split,
and the peak memory growth per rank.

Reference (``--check``):
    ``fp64``  usp_hal.reference.reference_attention in float64;
    ``sdpa``  torch scaled_dot_product_attention in float32 (float64 for fp64 inputs);
    ``auto``  fp64 while B*H*S^2 <= 2^25 (S <= 2048 at B=1, H=8), else sdpa.
Both run on blocks of query rows against the full keys (bounded memory); the row blocks
are divided among the ranks, the partial key/value gradients are summed over them, and
the distributed results are gathered with :func:`usp_hal.unshard` before comparing.

The functions named ``rank_*`` and ``single_*`` run inside the ranks / the single-process
baseline worker; ``usp-hal bench`` drives the same functions.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

from ..layout import layout_names
from ..rotation import rotation_names
from statistics import median

from ..harness import meter, pool
from ..harness.meter import fmt_bytes, fmt_ms

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
    proj: str = "none"           # none | sync (project, then attend) | overlap (async_qkv_attention)

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
        if nproc % ring:
            raise ValueError(f"--ring {ring} does not divide --nproc {nproc}; pick a ring degree that divides "
                             f"the number of ranks (or pass --ulysses too)")
        ulysses = nproc // ring
    elif ring is None:
        if nproc % ulysses:
            raise ValueError(f"--ulysses {ulysses} does not divide --nproc {nproc}; pick a Ulysses degree that "
                             f"divides the number of ranks (or pass --ring too)")
        ring = nproc // ulysses
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
    if cfg.seqlen < cfg.nproc:
        raise ValueError(f"--seqlen {cfg.seqlen} is shorter than the number of ranks ({cfg.nproc}); "
                         "every rank needs at least one token")
    if cfg.device_type != "cpu":
        from .. import platform as _platform
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

    from .. import platform as _platform
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
    from .. import platform as _platform
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


class _Case:
    pass


def rank_prepare(cfg: dict, case: str) -> dict:
    """Shard the inputs, run the first call (the one that is checked), and prepare the
    timers.  Keeps the state under ``case`` for rank_steps/rank_check."""
    import torch.distributed as dist

    import usp_hal
    cfg = RunConfig(**cfg)
    mesh = _mesh(cfg.ulysses, cfg.ring)
    q, k, v, dout = global_inputs(cfg)
    st = _Case()
    st.cfg, st.mesh = cfg, mesh

    def sh(x):
        return usp_hal.shard(x, layout=cfg.ring_impl, mesh=mesh, seq_dim=1).contiguous()

    st.q, st.k, st.v = (sh(x).requires_grad_(cfg.bwd) for x in (q, k, v))
    st.dout = sh(dout) if cfg.bwd else None
    if cfg.pipeline:
        st.attn = usp_hal.AsyncLongContextAttention(mesh=mesh, head_chunks=cfg.pipeline, **cfg.module_kwargs())
    else:
        st.attn = usp_hal.LongContextAttention(mesh=mesh, **cfg.module_kwargs())
    st.leaves = [st.q, st.k, st.v]
    st.call = lambda: st.attn(st.q, st.k, st.v, causal=cfg.causal)
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
    projs = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in st.weights]

    def sync_call():
        q, k, v = (p(st.hidden).view(cfg.batch, st.hidden.shape[1], h, cfg.head_dim) for p, h in zip(projs, heads))
        return st.attn(q, k, v, causal=cfg.causal)

    def overlap_call():
        return usp_hal.async_qkv_attention(st.attn, st.hidden, *projs, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                           head_dim=cfg.head_dim, causal=cfg.causal)
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

    from ..reference import reference_attention
    q, k, v, dout = global_inputs(cfg)
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    cdt = torch.float64 if (mode == "fp64" or cfg.dtype == "fp64") else torch.float32
    per_row = B * H * S * (8 if cdt == torch.float64 else 4)
    limit = FP64_BLOCK_BYTES if mode == "fp64" else SDPA_BLOCK_BYTES
    rows = max(1, limit // per_row)
    out = torch.empty(B, hi - lo, H, D, dtype=cdt, device=q.device)
    dq = torch.empty_like(out) if cfg.bwd else None
    dk = torch.zeros(B, S, Hkv, D, dtype=cdt, device=q.device) if cfg.bwd else None
    dv = torch.zeros_like(dk) if cfg.bwd else None
    for a, b in _row_blocks(lo, hi, rows):
        kend = b if cfg.causal else S
        with torch.enable_grad():
            qc = q[:, a:b].to(cdt).requires_grad_(cfg.bwd)
            kc = k[:, :kend].to(cdt).requires_grad_(cfg.bwd)
            vc = v[:, :kend].to(cdt).requires_grad_(cfg.bwd)
            if mode == "fp64":
                o, _ = reference_attention(qc, kc, vc, softmax_scale=scale, causal=cfg.causal, key_offset=-a)
            else:
                mask = None
                if cfg.causal:   # query a+m sees keys n <= a+m
                    m = torch.arange(a, b, device=q.device).unsqueeze(1)
                    mask = torch.arange(kend, device=q.device).unsqueeze(0) <= m
                kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
                if Hkv != H:
                    kt, vt = kt.repeat_interleave(H // Hkv, 1), vt.repeat_interleave(H // Hkv, 1)
                o = F.scaled_dot_product_attention(qc.transpose(1, 2), kt, vt, attn_mask=mask,
                                                   scale=scale).transpose(1, 2)
            out[:, a - lo:b - lo] = o.detach()
            if cfg.bwd:
                gq, gk, gv = torch.autograd.grad(o, (qc, kc, vc), dout[:, a:b].to(cdt))
                dq[:, a - lo:b - lo] = gq
                dk[:, :kend] += gk
                dv[:, :kend] += gv
    return out, dq, dk, dv


FP8_RMS_BUDGET = 0.05   # the fp8 wire format's error budget: RMS error <= 5% of RMS(reference)


def _compare(got, ref, atol: float, rtol: float, lossy: bool = False) -> dict:
    """Max error against the tolerance (``worst`` <= 1 passes); for the lossy fp8 wire
    format ``worst`` is the RMS error over the budget instead.  ``rms_rel``/``max_rel``:
    RMS(err)/RMS(ref) and max|err|/max|ref|."""
    import torch
    g = got.detach().to(ref.device, torch.float64)
    r = ref.detach().to(torch.float64)
    if g.shape != r.shape:
        return {"max_abs": None, "worst": math.inf, "problem": f"shape {tuple(g.shape)} != {tuple(r.shape)}"}
    diff = torch.nan_to_num((g - r).abs(), nan=math.inf)
    if not diff.numel():
        return {"max_abs": 0.0, "worst": 0.0, "rms_rel": 0.0, "max_rel": 0.0}
    rms_ref = float(r.pow(2).mean().sqrt()) or 1.0
    rms_rel = float(diff.pow(2).mean().sqrt()) / rms_ref
    max_rel = float(diff.max()) / (float(r.abs().max()) or 1.0)
    worst = rms_rel / FP8_RMS_BUDGET if lossy else float((diff / (atol + rtol * r.abs())).max())
    return {"max_abs": float(diff.max()), "worst": worst, "rms_rel": rms_rel, "max_rel": max_rel}


def reference_tolerance(cfg: RunConfig, mode: str) -> tuple:
    """(atol, rtol) for this check: the dtype's tolerance against float64; against a float32
    reference (which carries its own rounding of the same size) twice that."""
    from ..reference import tolerance
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
    full = {name: usp_hal.unshard(t, layout=cfg.ring_impl, mesh=mesh, seq_dim=1) for name, t in st.result.items()}
    rkey = (cfg.input_key(), cfg.causal, mode)
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
    errors = {"out": _compare(full["out"][:, lo:hi], out, atol, rtol, lossy)}
    if cfg.bwd and "dq" in full:
        errors["dq"] = _compare(full["dq"][:, lo:hi], dq, atol, rtol, lossy)
        errors["dk"] = _compare(full["dk"], dk, atol, rtol, lossy)
        errors["dv"] = _compare(full["dv"], dv, atol, rtol, lossy)
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
def single_prepare(cfg: dict, case: str) -> dict:
    """The backend the distributed run uses, called directly on the full sequence in one
    process: the baseline every configuration is compared with."""
    from ..capabilities import AttnRequest
    from ..registry import REGISTRY
    cfg = RunConfig(**cfg)
    q, k, v, dout = global_inputs(cfg)
    req = AttnRequest(dtype=q.dtype, device_type=cfg.device_type, head_dim=cfg.head_dim, num_heads=cfg.heads,
                      num_kv_heads=cfg.kv_heads, causal=cfg.causal, needs_grad=cfg.bwd, needs_lse=cfg.bwd)
    st = _Case()
    st.cfg = cfg
    st.backend = REGISTRY.select(cfg.attn_type, req)()
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
    scale = 1.0 / math.sqrt(cfg.head_dim)
    recs = []
    for _ in range(n):
        _sync(cfg.device_type)
        if memory:
            st.mem.start()
        t0 = time.perf_counter()
        out, lse = st.backend.forward(q, k, v, softmax_scale=scale, causal=cfg.causal)
        _sync(cfg.device_type)
        t1 = time.perf_counter()
        if cfg.bwd:
            st.backend.backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=cfg.causal)
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
            "work_balance": (max(work) / min(work)) if min(work) > 0 else None,
            "ranks": ranks, "kernel_balance": (max(kernel) / min(kernel)) if min(kernel) > 0 else None,
            "sent_per_rank": max(r["sent"] for r in ranks), "mem_per_rank": max(r["mem"] for r in ranks)}


def merge_checks(checks: list) -> dict:
    mode = checks[0]["mode"]
    errors = {}
    for c in checks:
        for name, e in c["errors"].items():
            cur = errors.get(name)
            if cur is None or (e["worst"] > cur["worst"]):
                errors[name] = e
    ok = all(e["worst"] <= 1.0 for e in errors.values())
    return {"mode": mode, "errors": errors, "tolerance": checks[0].get("tolerance"), "ok": ok,
            "lossy": checks[0].get("lossy", False)}


REFERENCE_TEXT = {
    "fp64": "float64 usp_hal.reference.reference_attention",
    "sdpa": "torch scaled_dot_product_attention in float32 (float64 for fp64 inputs)",
}


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
    return {"mem_method": mem_method, "config": asdict(cfg), "backend": prep[0]["backend"], "prepare": prep,
            "check": check,
            "summary": summary, "min_comm": min_comm_bytes(cfg),
            "input_bytes_per_rank": max(p["input_bytes"] for p in prep)}


def format_report(res: dict, launcher: str) -> str:
    cfg = RunConfig(**res["config"])
    s, chk = res["summary"], res["check"]
    from .. import platform as _platform
    try:
        dist_backend = _platform.dist_backend_string(cfg.device_type)
    except Exception:
        dist_backend = "?"
    mode = ("forward+backward" if cfg.bwd else "forward") + (", causal" if cfg.causal else ", not causal")
    lines = [
        f"usp-hal run: {cfg.nproc} rank(s) = ulysses {cfg.ulysses} x ring {cfg.ring} on {cfg.device_type} "
        f"({dist_backend}), {cfg.threads_per_rank} thread(s) per rank, {launcher}",
        f"  inputs     B={cfg.batch} S={cfg.seqlen} H={cfg.heads} Hkv={cfg.kv_heads} D={cfg.head_dim} {cfg.dtype}, "
        f"{mode}, seed {cfg.seed}",
        f"  layout     {cfg.ring_impl}, rotation {cfg.rotate}" + "".join(
            f", {k} {v}" for k, v in (("fp8", cfg.fp8), ("ring fp8", cfg.ring_fp8), ("pipeline", cfg.pipeline),
                                      ("projections", cfg.proj)) if v not in ("none", False, 0)),
        f"  backend    {res['backend']} (attn-type {cfg.attn_type})",
    ]
    if chk["mode"] == "none":
        lines.append("check: skipped (--check none)")
    else:
        atol, rtol = chk["tolerance"]
        lines.append(f"check against {REFERENCE_TEXT[chk['mode']]} on the same global inputs "
                     f"(query-row blocks split over the ranks)")
        if chk.get("lossy"):
            lines.append(f"  tolerance  fp8 wire format: RMS(err) <= {FP8_RMS_BUDGET:g} * RMS(ref) (lossy; the gradient "
                         "is the straight-through gradient of the quantised forward)")
        else:
            lines.append(f"  tolerance  |err| <= {atol:g} + {rtol:g} * |ref|")
        lines.append("  tensor  max abs error  rms err/rms ref  worst / tolerance  result")
        for name, e in chk["errors"].items():
            mabs = "nan" if e["max_abs"] is None else f"{e['max_abs']:.2e}"
            rms = "-" if e.get("rms_rel") is None else f"{e['rms_rel']:.2e}"
            lines.append(f"  {name:<6}  {mabs:<13}  {rms:<15}  {e['worst']:<17.3g}  "
                         f"{'pass' if e['worst'] <= 1 else 'FAIL'}")
    lines.append(f"time per iteration: {fmt_ms(s['time'])} ms (median over {cfg.iters} iterations of the max "
                 f"over ranks, after {cfg.warmup} warm-up)"
                 + (f"; forward {fmt_ms(s['fwd'])} ms, backward {fmt_ms(s['bwd'])} ms" if cfg.bwd else ""))
    lines.append("per rank (medians per iteration): kernel = inside the backend; comm = in collectives and "
                 "their waits; merge = ring out/lse merge; layout = Ulysses re-layout around the all-to-all; "
                 "other = the rest (buffers, copies, gradient sums, Python)")
    lines.append("  rank  total ms  kernel fwd  kernel bwd  comm   merge  layout  other  sent       peak memory")
    for r in s["ranks"]:
        lines.append(f"  {r['rank']:<4}  {fmt_ms(r['time']):<8}  {fmt_ms(r['kernel_fwd']):<10}  "
                     f"{fmt_ms(r['kernel_bwd']):<10}  {fmt_ms(r['comm']):<5}  {fmt_ms(r['merge']):<5}  "
                     f"{fmt_ms(r['layout']):<6}  {fmt_ms(r['other']):<5}  {fmt_bytes(r['sent']):<9}  "
                     f"{fmt_bytes(r['mem'])}")
    if s["kernel_balance"]:
        lines.append(f"  balance, max/min over ranks: kernel time {s['kernel_balance']:.3f}, kernel work (query-key "
                     f"pairs scored) {s['work_balance']:.3f}")
    mc = res["min_comm"]["total"]
    ratio = f" (x{s['sent_per_rank'] / mc:.2f})" if mc else ""
    r0 = s["ranks"][0]
    detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r0["bytes"].items() if v)
    lines.append(f"communication per rank and iteration: {fmt_bytes(s['sent_per_rank'])} sent"
                 + (f" (rank 0: {detail})" if detail else "") + f"; minimum for this split {fmt_bytes(mc)}{ratio}; "
                 f"plus {fmt_bytes(r0['metadata_bytes'])} of call metadata")
    lines.append(f"peak memory per rank above its inputs: {fmt_bytes(s['mem_per_rank'])} during one extra, untimed "
                 f"iteration ({res['mem_method']}); the rank's inputs: {fmt_bytes(res['input_bytes_per_rank'])}")
    if chk["mode"] != "none":
        lines.append("result: " + ("PASS" if chk["ok"] else "FAIL (error above tolerance)"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def add_common_arguments(p, *, sweep: bool = False) -> None:
    """Shape and run options shared with ``usp-hal bench``."""
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads; GQA if fewer)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--attn-type", default="auto", help="backend name or 'auto' (default auto)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="input dtype (default fp32)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random global inputs (default 0)")
    p.add_argument("--device", default=None,
                   help="device type (default: the accelerator if present, else cpu; USP_HAL_DEVICE also works)")



def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="run one USP attention configuration on N ranks: check it and time it",
        description=__doc__.split("\n\n")[0] + " Exit status: 0 pass, 1 check failed or a rank failed, "
                    "2 bad arguments.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: ulysses x ring, else 2)")
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: nproc / ring, else 1)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: nproc / ulysses)")
    p.add_argument("--seqlen", type=int, default=1024, help="global sequence length S (default 1024)")
    add_common_arguments(p)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default on)")
    p.add_argument("--bwd", action=argparse.BooleanOptionalAction, default=True,
                   help="also run and check the backward (default on)")
    p.add_argument("--ring-impl", default="zigzag", choices=layout_names(), help="sequence layout (default zigzag)")
    p.add_argument("--rotate", default="p2p", choices=rotation_names(), help="ring rotation (default p2p)")
    p.add_argument("--fp8", default="none", choices=FP8_CHOICES,
                   help="Ulysses wire format: none, qvo (q, v and the output in fp8), qkvo (k too)")
    p.add_argument("--ring-fp8", action="store_true", help="the ring's V blocks (K too with --fp8 qkvo) in fp8")
    p.add_argument("--pipeline", type=int, default=0, metavar="N",
                   help="AsyncLongContextAttention with N head groups (0: the synchronous module)")
    p.add_argument("--proj", default="none", choices=PROJ_CHOICES,
                   help="also project q/k/v from hidden states in the timed call: sync, or overlap (each projection "
                        "overlapped with the previous all-to-all); only the output is checked")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up iterations (default 1)")
    p.add_argument("--check", default="auto", choices=CHECKS,
                   help="reference for the check: auto (fp64 for small S, else sdpa), fp64, sdpa, none")
    p.add_argument("--timeout", type=float, default=900.0, help="limit for the whole run in seconds (default 900)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON ('-' = stdout)")
    p.set_defaults(func=run)


def device_type_from(args) -> str:
    from .. import platform as _platform
    if args.device:
        if args.device not in _platform.DEVICE_TYPES:
            raise ValueError(f"--device {args.device!r}; valid: {', '.join(_platform.DEVICE_TYPES)}")
        return args.device
    return _platform.default_device_type()


def config_from_args(args) -> RunConfig:
    nproc, U, R = resolve_split(args.nproc, args.ulysses, args.ring)
    if pool.in_torchrun():
        world = int(__import__("os").environ["WORLD_SIZE"])
        if args.nproc is None and args.ulysses is None and args.ring is None:
            nproc, U, R = resolve_split(world, None, None)
        elif nproc != world:
            raise ValueError(f"under torchrun the world size is {world} (torchrun --nproc_per_node x --nnodes), but "
                             f"the options ask for {nproc} ranks; drop --nproc, make --ulysses x --ring = {world}, or "
                             f"start torchrun with --nproc_per_node={nproc}")
    cfg = RunConfig(nproc=nproc, ulysses=U, ring=R, seqlen=args.seqlen, batch=args.batch, heads=args.heads,
                    kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, causal=args.causal,
                    bwd=args.bwd, attn_type=args.attn_type, ring_impl=args.ring_impl, rotate=args.rotate,
                    dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                    threads_per_rank=args.threads_per_rank, seed=args.seed, check=args.check,
                    device_type=device_type_from(args), fp8=args.fp8, ring_fp8=args.ring_fp8,
                    pipeline=args.pipeline, proj=args.proj)
    validate(cfg)
    return cfg


def run(args) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"usp-hal run: {exc}", file=sys.stderr)
        return 2
    torchrun = pool.in_torchrun()
    executor, finished = None, False
    try:
        if torchrun:
            executor = pool.TorchrunExecutor(cfg.threads_per_rank, cfg.device_type)
            launcher = f"torchrun rank {executor.rank} of {executor.world}"
        else:
            executor = pool.RankPool(cfg.nproc, threads=cfg.threads_per_rank, device_type=cfg.device_type,
                                        start_timeout=min(args.timeout, 300.0))
            launcher = "spawned on 127.0.0.1"
        res = execute(cfg, executor, args.timeout)
        finished = True
    except pool.LaunchError as exc:
        print(f"usp-hal run: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not torchrun:
            raise
        # under torchrun a failing rank exits; torchrun then stops the others
        rank = executor.rank if executor is not None else __import__("os").environ.get("RANK")
        print(f"usp-hal run (rank {rank}): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if executor is not None:
            if torchrun:   # every rank finished: wait for all, then tear the groups down together
                executor.close(ok=finished)
            else:
                executor.close()
    if torchrun and executor.rank != 0:
        return 0 if res["check"].get("ok", True) else 1
    print(format_report(res, launcher))
    if args.json:
        text = json.dumps(res, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if res["check"].get("ok", True) else 1
