"""The device check behind ``ci/device-check.sh``: every check a first GPU machine should run,
in one process tree, with a JSON report and a readable table.

    python ci/device_check.py OUTDIR [--dry-run] [--only PATTERN] [--list]

Each check is declared once in :data:`CHECKS` with the device it needs.  On a CUDA machine
every check runs.  ``--dry-run`` (or a machine without CUDA) runs the same code on the CPU:
the checks that need CUDA are printed by name as skipped, the others run with CPU tensors,
so the script and its code paths cannot rot between GPU runs.

Statuses: ``pass`` (compared and within tolerance, or the property held), ``fail`` (it ran
and was wrong, or raised), ``skip`` (needs a device this run does not have, or a package
that is missing; the reason is printed), ``info`` (a record, not a check: versions, timings).

What the multi-rank checks use on one GPU: NCCL refuses two ranks on one device, so the
ranks run as spawned processes on ``cuda:0`` with a gloo process group.  gloo's CUDA
all-to-all, all-gather and all-reduce stage device tensors through host memory and complete
before they return; its point-to-point send/recv cannot take CUDA tensors at all, so the ring's
``batch_isend_irecv`` is staged through host buffers for this check
(:func:`install_p2p_staging`).  These checks prove the CUDA code paths (real kernels,
usp-hal's streams and events, the non-blocking copies, the ring and all-to-all plumbing on
device tensors) and their results; they prove nothing about NCCL (its asynchronous work
handles and stream ordering), NVLink bandwidth or overlap timing.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import json
import math
import os
import platform as _pyplatform
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from usp_hal.harness.hostreads import first_call_kwargs

PEAK_BF16_TFLOPS = 790.0      # H200 SXM dense bf16, as the issue of this check states it (about 790)


# ----------------------------------------------------------------------------- plumbing
@dataclasses.dataclass
class Check:
    name: str
    needs: str                   # "cuda": skipped without CUDA; "": runs on the CPU too
    what: str
    fn: Callable[["Context"], dict]


@dataclasses.dataclass
class Context:
    device: str                  # "cuda" or "cpu"
    out: str
    dry_run: bool
    results: List[dict] = dataclasses.field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


class Skip(Exception):
    """A check that cannot run here (missing package, refused by the device)."""


def one_rank_mesh():
    """The 1 x 1 mesh: no process group, nothing exchanged."""
    from usp_hal.parallel.mesh import SequenceParallelMesh
    return SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,))


def _cmp(got, ref, dtype, lossy: bool = False, tol: Optional[tuple] = None) -> dict:
    from usp_hal.dispatch.reference import tolerance
    from usp_hal.harness.verify import compare
    atol, rtol = tol if tol is not None else tolerance(dtype)
    res = compare(got, ref, atol, rtol, lossy=lossy)
    return {"worst": None if not math.isfinite(res["worst"]) else round(res["worst"], 4),
            "max_abs": res["max_abs"], "ok": bool(res["ok"]), "problem": res["problem"]}


def _sum_up(parts: Dict[str, dict]) -> dict:
    """A check's result from named comparisons: fail when any failed."""
    bad = [f"{k}: {v.get('problem') or v.get('error')}" for k, v in parts.items() if not v.get("ok")]
    return {"status": "fail" if bad else "pass", "detail": "; ".join(bad[:6]), "data": parts}


def _rand(shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- environment
def check_env(ctx: Context) -> dict:
    import importlib.metadata as md
    data: Dict[str, Any] = {"python": _pyplatform.python_version(), "torch": torch.__version__,
                            "cuda_build": torch.version.cuda, "device": ctx.device}
    for dist_name in ("triton", "transformers", "accelerate", "diffusers", "sageattention"):
        try:
            data[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            data[dist_name] = None
    if ctx.cuda:
        data["gpu"] = torch.cuda.get_device_name(0)
        data["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        data["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
        data["cudnn"] = torch.backends.cudnn.version()
    return {"status": "info", "detail": ", ".join(f"{k} {v}" for k, v in data.items() if v is not None), "data": data}


# ----------------------------------------------------------------------------- sdpa ops
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def _raw_lse(name: str, q, k, v, causal: bool, scale: float):
    """The aten op's (out, lse) for one backend, inputs [B, H, S, D] (None for math: no lse)."""
    aten = torch.ops.aten
    if name == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    elif name == "efficient":
        res = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    elif name == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        return None
    return res[0], res[1]


def sdpa_op_case(device: str, backend: str, dtype, *, causal: bool, sq: int, sk: int, h: int, hkv: int,
                 d: int, seed: int = 0) -> dict:
    """torch's public SDPA restricted to one backend, forward and gradients vs float64; for
    the backends that return one, the aten op's lse (layout normalised as the sdpa adapter
    does) vs the float64 lse.  A backend that refuses the case says so (``refused``)."""
    from torch.nn.attention import sdpa_kernel

    from usp_hal.backends.sdpa import normalize_cuda_lse
    from usp_hal.dispatch.reference import reference_attention
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (_rand((1, s, n, d), dtype, device, gen) for s, n in ((sq, h), (sk, hkv), (sk, hkv)))
    dout = _rand((1, sq, h, d), dtype, device, gen)
    scale = 1.0 / math.sqrt(d)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = reference_attention(qr, kr, vr, softmax_scale=scale, causal=causal)
    ref.backward(dout.double())
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    t = lambda x: x.transpose(1, 2)      # noqa: E731
    try:
        with sdpa_kernel([_sdpa_backend(backend)]):
            out = torch.nn.functional.scaled_dot_product_attention(
                t(qg), t(kg), t(vg), is_causal=causal, scale=scale, enable_gqa=hkv != h)
            out = t(out)
            out.backward(dout)
    except RuntimeError as exc:
        return {"ok": True, "refused": str(exc).splitlines()[0][:200]}
    parts = {"out": _cmp(out, ref, dtype), "dq": _cmp(qg.grad, qr.grad, dtype),
             "dk": _cmp(kg.grad, kr.grad, dtype), "dv": _cmp(vg.grad, vr.grad, dtype)}
    if backend != "math" and hkv == h:
        try:
            with torch.no_grad():
                got = _raw_lse(backend, t(q), t(k), t(v), causal, scale)
            if got is not None:
                lse = normalize_cuda_lse(got[1], sq).float()
                parts["lse"] = _cmp(lse, ref_lse.detach(), dtype, tol=tolerance_lse(dtype))
                parts["lse"]["layout"] = list(got[1].shape)
        except RuntimeError as exc:
            parts["lse"] = {"ok": True, "refused": str(exc).splitlines()[0][:200]}
    return {"ok": all(p.get("ok") for p in parts.values()), **parts}


def tolerance_lse(dtype) -> tuple:
    from usp_hal.dispatch.reference import tolerance
    return tolerance(dtype, lse=True)


def _sdpa_op_check(backend: str, dtype_name: str):
    def run(ctx: Context) -> dict:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
        cases = {}
        n = 333 if ctx.cuda else 67           # odd lengths; small on the CPU (the dry run's time)
        for causal in (False, True):
            for h, hkv in ((8, 8), (8, 2)):
                for sq, sk in ((n, n), (n * 3 // 5, n)):
                    if causal and sq != sk:
                        continue        # SDPA's is_causal is top-left for Sq != Sk on some backends only
                    name = f"{'causal' if causal else 'full'} H{h}/{hkv} S{sq}x{sk}"
                    cases[name] = sdpa_op_case(ctx.device, backend, dtype, causal=causal, sq=sq, sk=sk, h=h,
                                               hkv=hkv, d=64)
        ran = [c for c in cases.values() if "refused" not in c]
        res = _sum_up(cases)
        refused = [f"{n}: {c['refused']}" for n, c in cases.items() if "refused" in c]
        if not ran:
            return {"status": "fail" if backend in ("flash", "efficient", "math") else "skip",
                    "detail": "every case refused: " + "; ".join(refused[:2]), "data": cases}
        if refused:
            res["detail"] = (res["detail"] + "; " if res["detail"] else "") + f"{len(refused)} case(s) refused: " \
                + refused[0]
        return res
    return run


# ----------------------------------------------------------------------------- adapters
def _backend_cls(name: str):
    from usp_hal.dispatch.registry import REGISTRY
    cls = REGISTRY.get(name)
    av = cls.availability()
    if not av.ok:
        raise Skip(f"{name} unavailable: {av.reason}")
    return cls


def kernel_case(device: str, attn_type: str, dtype, *, causal: bool, s: int, h: int, hkv: int, d: int,
                grad: bool, lse: bool, through_module: bool, mask=None, mask_dense=None, sinks: bool = False,
                lossy: bool = False, seed: int = 0) -> dict:
    """One kernel on one rank against float64: through the adapter (``kernel.forward`` /
    ``backward``) or through ``LongContextAttention`` on a 1 x 1 mesh."""
    from usp_hal.attention import LongContextAttention
    from usp_hal.dispatch.reference import reference_attention
    from usp_hal.dispatch.registry import REGISTRY
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (_rand((2, s, n, d), dtype, device, gen) for n in (h, hkv, hkv))
    dout = _rand((2, s, h, d), dtype, device, gen)
    snk = _rand((h,), torch.float32, device, gen) if sinks else None
    scale = 1.0 / math.sqrt(d)
    qr, kr, vr = (x.detach().double().requires_grad_(grad) for x in (q, k, v))
    ref, ref_lse = reference_attention(qr, kr, vr, softmax_scale=scale, causal=causal, mask=mask_dense, sinks=snk)
    if grad:
        ref.backward(dout.double())
    qg, kg, vg = (x.detach().requires_grad_(grad) for x in (q, k, v))
    tol = None
    cls = REGISTRY.get(attn_type)
    if lossy:
        from usp_hal.harness.verify import tolerances_for
        tol = tolerances_for(cls, dtype)
    if through_module:
        attn = LongContextAttention(attn_type=attn_type, mesh=one_rank_mesh())
        kw: Dict[str, Any] = dict(causal=causal, softmax_scale=scale)
        if mask is not None:
            kw["mask"] = mask
        if snk is not None:
            kw["sinks"] = snk
        if lse:
            out, got_lse = attn(qg, kg, vg, return_lse=True, **kw)[:2]
        else:
            out, got_lse = attn(qg, kg, vg, **kw), None
    else:
        from usp_hal.dispatch.capabilities import KernelCall
        kernel = cls()
        call = KernelCall(scale=scale, causal=causal)
        with torch.no_grad():
            out, got_lse = kernel.forward(q, k, v, call)
    parts = {"out": _cmp(out, ref, dtype, tol=tol)}
    if lse and got_lse is not None:
        parts["lse"] = _cmp(got_lse.float(), ref_lse.detach(), dtype, tol=tol or tolerance_lse(dtype))
    if grad:
        if through_module:
            out.backward(dout)
            grads = (qg.grad, kg.grad, vg.grad)
        else:
            with torch.no_grad():
                grads = kernel.backward(dout, q, k, v, out, got_lse, call)
        for n, g, r in zip(("dq", "dk", "dv"), grads, (qr.grad, kr.grad, vr.grad)):
            parts[n] = _cmp(g, r, dtype, tol=tol)
    return {"ok": all(p["ok"] for p in parts.values()), **parts}


NONFINITE_ROWS = ((5, 0, 3, "nan"), (2, 1, 0, "inf"))      # (token, head, channel, value) put into q


def nonfinite_case(device: str, dtype, *, causal: bool, s: int, h: int = 2, d: int = 64) -> dict:
    """A NaN and an inf in q (:data:`NONFINITE_ROWS`).  Facts: whether the sdpa adapter's kernel
    (and, on CUDA, each torch SDPA backend) carries them into exactly those out (and lse) rows by
    itself.  Checked: ``LongContextAttention`` on a 1 x 1 mesh makes exactly those rows
    non-finite, forward only (where the guard is folded into the output) and with the lse and
    gradients (dq's rows too), and every other row equals float64 attention.  (torch 2.13's CPU
    op hides a NaN query row that sees fewer than 16 keys and carries it with more: the facts are
    per length.)"""
    from usp_hal.attention import LongContextAttention
    from usp_hal.dispatch.reference import reference_attention
    from usp_hal.dispatch.registry import REGISTRY
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (_rand((1, s, h, d), dtype, device, gen) for _ in range(4))
    want = torch.zeros(s, h, dtype=torch.bool)
    for t, head, c, value in NONFINITE_ROWS:
        q[0, t, head, c] = float(value)
        want[t, head] = True
    want = want.to(device)
    clean = q.masked_fill(want.view(1, s, h, 1), 0.0)     # other rows do not depend on these ones
    ref, _ = reference_attention(clean.double(), k.double(), v.double(), causal=causal)

    def rows(x):              # [S, H]: which rows hold a non-finite value
        return ~torch.isfinite(x[0].float()).all(-1)

    def lse_rows(lse):        # the same for an lse [B, H, S]
        return ~torch.isfinite(lse[0]).T

    def module_ok(out, what):
        fine = ~want.view(1, s, h, 1).expand_as(out)
        cmp = _cmp(torch.where(fine, out, torch.zeros_like(out)), torch.where(fine, ref, torch.zeros_like(ref)),
                   dtype)
        cmp["rows_exact"] = bool(torch.equal(rows(out), want))
        cmp["ok"] = cmp["ok"] and cmp["rows_exact"]
        if not cmp["rows_exact"]:
            cmp["problem"] = f"{what}: non-finite rows {rows(out).nonzero().tolist()}, want {want.nonzero().tolist()}"
        return cmp

    facts: Dict[str, Any] = {}
    with torch.no_grad():
        from usp_hal.dispatch.capabilities import KernelCall
        out, lse = REGISTRY.get("sdpa")().forward(q, k, v, KernelCall(causal=causal))
        facts["adapter_out_carries"] = bool(torch.equal(rows(out), want))
        facts["adapter_lse_carries"] = bool(torch.equal(lse_rows(lse), want))
        if device == "cuda":
            from torch.nn.attention import sdpa_kernel
            for b in SDPA_BACKENDS:
                try:
                    with sdpa_kernel(_sdpa_backend(b)):
                        o = torch.nn.functional.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                    facts[f"{b}_out_carries"] = bool(torch.equal(rows(o.transpose(1, 2)), want))
                except Exception as exc:
                    facts[f"{b}_out_carries"] = f"{type(exc).__name__}: {exc}"[:120]
    attn = LongContextAttention(attn_type="sdpa", mesh=one_rank_mesh())
    parts = {}
    with torch.no_grad():
        parts["forward"] = module_ok(attn(q, k, v, causal=causal), "forward only")
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = attn(qg, kg, vg, causal=causal, return_lse=True)[:2]
    parts["grad"] = module_ok(out.detach(), "with gradients")
    lse_ok = bool(torch.equal(lse_rows(lse), want))
    out.backward(dout)
    dq_ok = bool(rows(qg.grad)[want].all())
    parts["grad"]["ok"] = parts["grad"]["ok"] and lse_ok and dq_ok
    if not (lse_ok and dq_ok):
        parts["grad"]["problem"] = f"lse rows exact: {lse_ok}, dq's bad rows non-finite: {dq_ok}"
    return {"ok": all(p["ok"] for p in parts.values()), **parts, "facts": facts}


def check_nonfinite(ctx: Context) -> dict:
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cases = {}
    for s in (8, 37):
        for causal in (False, True):
            name = f"S{s} {'causal' if causal else 'full'}"
            try:
                cases[name] = nonfinite_case(ctx.device, dtype, causal=causal, s=s)
            except Exception as exc:
                cases[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return _sum_up(cases)


# CUDA dtypes per backend: flex compiles one Triton kernel (and its backward) per call
# structure, so it runs fewer cases there (the check's time budget)
CUDA_DTYPES = {"sdpa": (torch.bfloat16, torch.float16, torch.float32), "flex": (torch.bfloat16,),
               "sage_fp8": (torch.bfloat16, torch.float16)}


def _kernel_check(attn_type: str, through_module: bool):
    def run(ctx: Context) -> dict:
        cls = _backend_cls(attn_type)
        from usp_hal.harness.verify import base_request, feature_change
        dtypes = CUDA_DTYPES[attn_type] if ctx.cuda else (torch.float32,)
        few = ctx.cuda and attn_type == "flex"
        cases = {}
        for dtype in dtypes:
            base = base_request(cls, ctx.device, dtype)
            if cls.not_supported_reasons(base):
                cases[str(dtype)] = {"ok": True, "refused": "; ".join(cls.not_supported_reasons(base))}
                continue
            grad = feature_change(cls, base, "bwd") is not None
            lse = feature_change(cls, base, "ring") is not None
            lossy = bool(getattr(cls, "LOSSY_TOLERANCES", None))
            for causal in (False, True):
                if attn_type == "sage_fp8" and not causal:
                    s = 320              # the sage kernel 1.0.6 non-causal needs Sk % 64 == 0 (declared limit)
                else:
                    s = 333 if ctx.cuda else 67
                for h, hkv in ((8, 8), (8, 2)):
                    if few and causal != (hkv != h):
                        continue         # flex on CUDA: full MHA and causal GQA only
                    name = f"{str(dtype).replace('torch.', '')} {'causal' if causal else 'full'} H{h}/{hkv} S{s}"
                    try:
                        cases[name] = kernel_case(ctx.device, attn_type, dtype, causal=causal, s=s, h=h, hkv=hkv,
                                                  d=64, grad=grad, lse=lse, through_module=through_module,
                                                  lossy=lossy)
                    except Exception as exc:
                        cases[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        return _sum_up(cases)
    return run


def _block_mod(block: int):
    def mod(b, h, q_idx, kv_idx):
        return (q_idx // block) >= (kv_idx // block)
    return mod


def check_flex_features(ctx: Context) -> dict:
    """flex through LongContextAttention on one rank: a block mask whose blocks (100) end
    mid-tile, and sinks, forward and (on CUDA) gradients and lse vs float64."""
    from usp_hal.sequence.masks import Mask
    _backend_cls("flex")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    s, block = (333, 100) if ctx.cuda else (67, 20)     # blocks that end inside flex's 128-wide tiles
    mod = _block_mod(block)
    mask = Mask.from_mod(mod, name=f"block{block}")
    idx = torch.arange(s, device=ctx.device)
    dense = mod(None, None, idx[:, None], idx[None, :])
    cases = {}
    for name, kw in (("mask", dict(mask=mask, mask_dense=dense)), ("sinks", dict(sinks=True)),
                     ("mask+sinks causal", dict(mask=mask, mask_dense=dense, sinks=True, causal=True))):
        causal = kw.pop("causal", False)
        try:
            cases[name] = kernel_case(ctx.device, "flex", dtype, causal=causal, s=s, h=8, hkv=2, d=64,
                                      grad=ctx.cuda, lse=True, through_module=True, **kw)
        except Exception as exc:
            cases[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return _sum_up(cases)


# ----------------------------------------------------------------------------- several ranks
MULTIRANK_CASES = {
    2: ["U2", "R2-p2p", "R2-allgather", "U2-async", "U2-fp8", "R2-fp8", "R2-mask", "U2-packed", "R2-packed"],
    4: ["U2xR2", "U2xR2-async", "U2xR2-mask"],
}


class _StagedWork:
    """The work of a p2p batch whose CUDA tensors travel through host buffers: waiting
    waits for gloo, then copies each received host buffer into its CUDA tensor."""

    def __init__(self, works, copies):
        self.works, self.copies = list(works or []), copies

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        for dst, src in self.copies:
            dst.copy_(src)
        self.copies = []
        return True

    def is_completed(self):
        return not self.copies and all(w.is_completed() for w in self.works)


def install_p2p_staging() -> bool:
    """On gloo, point-to-point sends of CUDA tensors cannot work: ProcessGroupGloo::send and
    ::recv hand the tensor's raw data pointer to gloo's TCP transport with no device handling
    (pytorch torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, send/recv), unlike its
    all-to-all, all-gather and all-reduce, which stage CUDA tensors themselves.  So for the
    one-GPU check, ``batch_isend_irecv`` of CUDA tensors is wrapped to send host copies and
    copy what arrives back to the device at ``wait()``.  The ring's own code (its CUDA
    kernels, merges, buffers and streams) runs unchanged; NCCL's p2p is not what runs."""
    import torch.distributed as dist
    orig = dist.batch_isend_irecv
    if getattr(orig, "_staged", False):
        return False

    def staged(ops):
        if not any(op.tensor.is_cuda for op in ops):
            return orig(ops)
        new_ops, copies = [], []
        for op in ops:
            t = op.tensor
            if not t.is_cuda:
                new_ops.append(op)
                continue
            if op.op is dist.irecv or getattr(op.op, "__name__", "") == "irecv":
                host = torch.empty(t.shape, dtype=t.dtype)
                copies.append((t, host))
            else:
                host = t.detach().contiguous().cpu()
            peer = getattr(op, "peer", None)
            group_peer = getattr(op, "group_peer", None)
            kw = {"group_peer": group_peer} if peer is None and group_peer is not None else {}
            new_ops.append(dist.P2POp(op.op, host, peer, op.group, getattr(op, "tag", 0), **kw))
        return [_StagedWork(orig(new_ops), copies)]
    staged._staged = True  # type: ignore[attr-defined]
    dist.batch_isend_irecv = staged
    return True


def transport_probe(device: str) -> dict:
    """Which collectives the group runs on ``device`` tensors (one rank's view); on CUDA the
    p2p batch goes through :func:`install_p2p_staging`."""
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(0)
        install_p2p_staging()
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    x = torch.full((world * 4,), float(rank), device=device)

    def a2a():
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        return float(y[4 * ((rank + 1) % world)].cpu()) == float((rank + 1) % world)

    def ag():
        y = torch.empty(world * x.numel(), device=device)
        dist.all_gather_into_tensor(y, x)
        return float(y[-1].cpu()) == float(world - 1)

    def p2p():
        y = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return float(y[0].cpu()) == float((rank - 1) % world)

    def ar():
        y = x.clone()
        dist.all_reduce(y)
        return float(y[0].cpu()) == float(sum(range(world)))

    for name, fn in (("all_to_all_single", a2a), ("all_gather_into_tensor", ag),
                     ("batch_isend_irecv" + (" (staged through host)" if device == "cuda" else ""), p2p),
                     ("all_reduce", ar)):
        try:
            res[name] = "ok" if fn() else "wrong result"
        except Exception as exc:
            res[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return res


def _doc_mask(cu: List[int], s: int, device) -> torch.Tensor:
    doc = torch.zeros(s, dtype=torch.long, device=device)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = i
    return doc[:, None] == doc[None, :]


def multirank_case(device: str, case: str, seed: int = 0) -> dict:
    """One multi-rank case on this rank: forward and gradients against float64, this rank's
    part of the reference cut with the same layout.  Runs on every rank of the group."""
    import torch.distributed as dist

    import usp_hal
    from usp_hal.dispatch.reference import reference_attention
    from usp_hal.sequence.masks import Mask
    if device == "cuda":
        torch.cuda.set_device(0)
    world = dist.get_world_size()
    u = 2 if case.startswith("U2") else 1
    r = world // u
    mesh = usp_hal.init_sequence_parallel(u, r, set_default=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h, hkv, d = 8, 2, 64
    s, block = (509, 100) if device == "cuda" else (131, 25)
    causal = True
    layout = "zigzag"
    kw: Dict[str, Any] = {}
    call: Dict[str, Any] = {}
    mask_dense = None
    cu = None
    lossy = False
    if "allgather" in case:
        kw["rotation"] = "allgather"
    if "fp8" in case:
        if case.startswith("U2"):
            kw["ulysses_float8"] = True
        else:
            kw["ring_float8"] = True
        lossy = True
    if "mask" in case:
        mod = _block_mod(block)
        call["mask"] = Mask.from_mod(mod, name=f"block{block}")
        idx = torch.arange(s, device=device)
        mask_dense = mod(None, None, idx[:, None], idx[None, :])
        causal = False
    if "packed" in case:
        cu = [0, s // 5, s * 3 // 5, s]
        layout = "varlen_zigzag"
        call["cu_seqlens"] = cu
        mask_dense = _doc_mask(cu, s, device)
    cls = usp_hal.AsyncLongContextAttention if "async" in case else usp_hal.LongContextAttention
    attn = cls(attn_type="sdpa", ring_impl_type=layout, mesh=mesh, **kw)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (_rand((1, s, n, d), dtype, device, gen) for n in (h, hkv, hkv))
    dout = _rand((1, s, h, d), dtype, device, gen)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, causal=causal, mask=mask_dense)
    ref.backward(dout.double())

    def mine(x):
        return usp_hal.shard(x, layout=layout, mesh=mesh, cu_seqlens=cu) if cu else \
            usp_hal.shard(x, layout=layout, mesh=mesh)
    ql, kl, vl = (mine(x).detach().contiguous().requires_grad_() for x in (q, k, v))
    out = attn(ql, kl, vl, causal=causal, **call)
    out.backward(mine(dout).contiguous())
    if device == "cuda":
        torch.cuda.synchronize()
    tol = None
    if lossy:
        parts = {"out": _cmp(out, mine(ref.detach()), dtype, lossy=True)}
    else:
        parts = {"out": _cmp(out, mine(ref.detach()), dtype, tol=tol)}
    # the backward of a lossy forward is the straight-through gradient: compared loosely
    for n, g, rg in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
        parts[n] = _cmp(g, mine(rg), dtype, lossy=lossy)
    return {"ok": all(p["ok"] for p in parts.values()), **parts}


def multirank_one(device: str, case: str) -> dict:
    """One case as a task of its own (a crash or a hang costs that case only)."""
    if device == "cuda":
        torch.cuda.set_device(0)
        install_p2p_staging()
    try:
        return multirank_case(device, case)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def fla_state_passing_case(device: str, op: str) -> dict:
    """fla's gated DeltaNet (op "gdn") or KDA ("kda") kernel as the per-rank kernel of usp-hal's
    state passing on Ring-2 (zigzag, packed documents): out and dq/dk/dv/dg/dbeta vs the float64
    recurrence over the whole sequence.  CUDA: fla's Triton chunk kernel, fp32 inputs; CPU: its
    torch reference kernel (naive_chunk_*)."""
    import usp_hal
    from usp_hal.integrations import fla as usp_fla
    from usp_hal.mixers import state_passing as sp
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = usp_hal.init_sequence_parallel(1, 2, set_default=False)
    kernel = ("chunk_" if device == "cuda" else "naive_chunk_") + ("kda" if op == "kda" else "gated_delta_rule")
    S, H, dk, dv = (300, 4, 64, 64) if device == "cuda" else (26, 2, 16, 16)
    cu = (0, S // 3, S - 7, S)
    gen = torch.Generator().manual_seed(5)
    gshape = (1, S, H, dk) if op == "kda" else (1, S, H)
    glob = {"q": torch.randn(1, S, H, dk, generator=gen),
            "k": torch.nn.functional.normalize(torch.randn(1, S, H, dk, generator=gen), dim=-1),
            "v": torch.randn(1, S, H, dv, generator=gen),
            "g": -torch.rand(*gshape, generator=gen) * 0.5, "beta": torch.rand(1, S, H, generator=gen)}
    dout = torch.randn(1, S, H, dv, generator=gen)
    ref_in = {n: t.double().requires_grad_() for n, t in glob.items()}
    ref = torch.cat([sp.delta_rule_reference(*(ref_in[n][:, a:b] for n in ("q", "k", "v", "g", "beta")))[0]
                     for a, b in zip(cu[:-1], cu[1:])], dim=1)
    ref.backward(dout.double())

    def sh(t):
        return usp_hal.shard(t, layout="varlen_zigzag", mesh=mesh, cu_seqlens=cu)
    loc = {n: sh(t).to(device).requires_grad_() for n, t in glob.items()}
    out = usp_fla.gated_delta_rule(*(loc[n] for n in ("q", "k", "v", "g", "beta")), mesh=mesh,
                                   layout="varlen_zigzag", cu_seqlens=cu, kernel=kernel)
    out.backward(sh(dout).to(device))
    tol = (5e-3, 5e-3) if device == "cuda" else (2e-4, 2e-4)     # fla's Triton dots may run in tf32
    parts = {"out": _cmp(out.detach().cpu(), sh(ref.detach()), torch.float32, tol=tol)}
    for n, t in loc.items():
        parts["d" + n] = _cmp(t.grad.cpu(), sh(ref_in[n].grad), torch.float32, tol=tol)
    bad = [k for k, v in parts.items() if not v["ok"]]
    return {"ok": not bad, "kernel": kernel, "problem": ", ".join(f"{k} worst {parts[k]['worst']}" for k in bad)}


def fla_state_passing_one(device: str, op: str) -> dict:
    try:
        import fla  # noqa: F401  (here, where the kernel runs: the launcher never imports it)
    except ImportError as exc:
        return {"not_installed": str(exc)}
    try:
        return fla_state_passing_case(device, op)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def _fla_missing(why) -> Skip:
    return Skip(f"flash-linear-attention is not installed ({why}); pip install --no-deps "
                "flash-linear-attention==0.6.0 fla-core==0.6.0 (pure Python; einops needed)")


def _fla_check(op: str):
    def run(ctx: Context) -> dict:
        # fla (and the transformers it imports) is imported by the ranks only: importing it here
        # as well cost the launcher seconds of the budget; an absent package is skipped without
        # starting ranks, one that is there but does not import is skipped as the ranks report
        import importlib.util
        if importlib.util.find_spec("fla") is None:
            raise _fla_missing("No module named 'fla'")
        got = _run_on_ranks(2, fla_state_passing_one, 180 if ctx.cuda else 120, device=ctx.device, op=op)
        if isinstance(got, Exception):
            return {"status": "fail", "detail": f"the 2 ranks failed: {str(got)[:400]}"}
        missing = [res["not_installed"] for res in got if "not_installed" in res]
        if missing:
            raise _fla_missing(missing[0])
        return _sum_up({f"rank {r}": res for r, res in enumerate(got)})
    return run


_POOLS: Dict[int, Any] = {}


def _pool(world: int):
    from usp_hal.harness.pool import RankPool
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = RankPool(world, threads=1, device_type="cpu", start_timeout=180)
    return pool


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _run_on_ranks(world: int, fn, timeout: float, **kwargs) -> Any:
    """Every rank's result (a list), or the exception that ended the run."""
    from usp_hal.harness.pool import LaunchError
    try:
        res = _pool(world).run_all(fn, timeout, **kwargs)
    except (LaunchError, TimeoutError) as exc:
        return exc
    bad = [f"rank {r}: {x[1]}" for r, x in res.items() if x[0] != "ok"]
    if bad:
        return RuntimeError("; ".join(bad)[:600])
    return [res[r][1] for r in sorted(res)]


def _multirank_check(world: int, case: str):
    def run(ctx: Context) -> dict:
        got = _run_on_ranks(world, multirank_one, 180 if ctx.cuda else 150, device=ctx.device, case=case)
        if isinstance(got, Exception):
            return {"status": "fail", "detail": f"the {world} ranks failed: {str(got)[:400]}"}
        return _sum_up({f"rank {r}": res for r, res in enumerate(got)})
    return run


def _transport_check(world: int):
    def run(ctx: Context) -> dict:
        got = _run_on_ranks(world, transport_probe, 120, device=ctx.device)
        if isinstance(got, Exception):
            return {"status": "fail", "detail": f"the {world} ranks failed: {str(got)[:400]}"}
        t = got[0]
        bad = [k for k, v in t.items() if v != "ok"]
        return {"status": "fail" if bad else "pass", "detail": ", ".join(f"{k} {v}" for k, v in t.items()),
                "data": t}
    return run


# ----------------------------------------------------------------------------- no hidden syncs
def steady_sync_case(device: str, u: int, r: int, calls: int = 3, timed: int = 20) -> dict:
    """Rank 0 of torch's fake process group of ``u * r`` ranks (the exchanges do nothing, so
    only usp-hal's own host work and device launches remain): after one checked call, the
    steady forward+backward with checks after the first call runs ``calls`` times under
    ``torch.cuda.set_sync_debug_mode("error")`` (CUDA) or the host-read meter (CPU).  Also
    the host time per forward call with the check at every call and at the first only."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import usp_hal
    from usp_hal.harness.hostreads import HostReadMeter
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=u * r)
    bare_a2a = dist.all_to_all_single

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        # the fake group wants one shape: flat views of as many bytes
        return bare_a2a(output.view(-1), input.reshape(-1), None, None, group=group, async_op=async_op)
    dist.all_to_all_single = a2a
    try:
        mesh = usp_hal.init_sequence_parallel(u, r, set_default=False)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        n, h, d = 256, 8, 64
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (_rand((1, n, h, d), dtype, device, gen) for _ in range(4))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        steady = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, **first_call_kwargs())

        def step():
            out = steady(*leaves, causal=True)
            out.backward(dout)
            for t in leaves:
                t.grad = None
        step()
        step()
        res: Dict[str, Any] = {"ok": True}
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(calls):
                    step()
            except RuntimeError as exc:
                res.update(ok=False, problem=f"{exc}".splitlines()[0][:300],
                           site="".join(traceback.format_exc(limit=-4))[-1200:])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        else:
            with HostReadMeter() as m:
                for _ in range(calls):
                    step()
            res["host_reads"] = m.reads["device"]
            res["sites"] = m.sites
            if m.reads["device"]:
                res.update(ok=False, problem=f"{m.reads['device']} host read(s) of tensor data in {calls} steady calls")
        every = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
        first = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh, **first_call_kwargs())
        times = {}
        with torch.no_grad():
            for name, attn in (("every call", every), ("first call", first)):
                for _ in range(3):
                    attn(q, k, v, causal=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(timed):
                    attn(q, k, v, causal=True)
                times[name] = (time.perf_counter() - t0) / timed * 1e6
                if device == "cuda":
                    torch.cuda.synchronize()
        res["host_us_per_forward"] = {k2: round(v2, 1) for k2, v2 in times.items()}
        return res
    finally:
        dist.all_to_all_single = bare_a2a
        dist.destroy_process_group()


def _in_child(fn, timeout: float, **kwargs):
    """``fn(**kwargs)`` in a fresh process (a process group of its own; a crash stays there)."""
    from usp_hal.harness.pool import RankPool
    with RankPool(1, threads=2, device_type="cpu", init_dist=False, start_timeout=120) as pool:
        return pool.run(fn, timeout, **kwargs)[0]


SYNC_MESHES = ((1, 1), (2, 1), (1, 2))
_SYNC_RESULTS: Dict[str, Any] = {}


def steady_sync_cases(device: str) -> dict:
    out = {}
    for u, r in SYNC_MESHES:
        try:
            out[f"U{u}R{r}"] = steady_sync_case(device, u, r)
        except Exception as exc:
            out[f"U{u}R{r}"] = {"ok": False, "problem": f"{type(exc).__name__}: {exc}"[:400],
                                "host_us_per_forward": None}
    return out


def _sync_check(u: int, r: int):
    def run(ctx: Context) -> dict:
        if "all" not in _SYNC_RESULTS:
            _SYNC_RESULTS["all"] = _in_child(steady_sync_cases, 300, device=ctx.device)
        got = _SYNC_RESULTS["all"][f"U{u}R{r}"]
        how = "set_sync_debug_mode('error')" if ctx.cuda else "host-read meter (CPU stand-in for the sync check)"
        detail = f"{how}; host us per forward: {got['host_us_per_forward']}"
        if not got["ok"]:
            detail = f"{got['problem']}; " + detail
        return {"status": "pass" if got["ok"] else "fail", "detail": detail, "data": got}
    return run


# ----------------------------------------------------------------------------- CUDA graphs
def check_cuda_graph(ctx: Context) -> dict:
    """One rank, checks after the first call: the forward captured in a CUDA graph and
    replayed equals the eager forward on the same inputs (bitwise: the same kernels)."""
    import usp_hal
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=one_rank_mesh(), **first_call_kwargs())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_rand((1, 1024, 8, 64), torch.bfloat16, "cuda", gen) for _ in range(3))
    with torch.no_grad():
        eager = attn(q, k, v, causal=True).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                attn(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = attn(q, k, v, causal=True)
        for x in (q, k, v):
            x.copy_(_rand(tuple(x.shape), torch.bfloat16, "cuda", gen))
        fresh = attn(q, k, v, causal=True).clone()
        graph.replay()
        torch.cuda.synchronize()
    same = torch.equal(static_out, fresh)
    differs_from_old = not torch.equal(static_out, eager)
    ok = same and differs_from_old
    return {"status": "pass" if ok else "fail",
            "detail": f"replay equals eager on new inputs: {same}; replay used the new inputs: {differs_from_old}",
            "data": {"max_abs": float((static_out.float() - fresh.float()).abs().max())}}


# ----------------------------------------------------------------------------- timings
def _cuda_time(fn, n: int) -> tuple:
    """(host microseconds per call, device milliseconds per call) over ``n`` calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n


def _timing_row(s: int, h: int, hkv: int, causal: bool) -> dict:
    import usp_hal
    from usp_hal.backends.sdpa import cuda_ops
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_rand((1, s, n, 128), torch.bfloat16, "cuda", gen) for n in (h, hkv, hkv))
    every = usp_hal.LongContextAttention(attn_type="sdpa", mesh=one_rank_mesh())
    steady = usp_hal.LongContextAttention(attn_type="sdpa", mesh=one_rank_mesh(), **first_call_kwargs())
    flash = cuda_ops()[0]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = (x.repeat_interleave(h // hkv, dim=1) for x in (kt, vt))
    row = {}
    with torch.no_grad():
        for name, fn in (("usp-hal every call", lambda: every(q, k, v, causal=causal)),
                         ("usp-hal first call", lambda: steady(q, k, v, causal=causal)),
                         ("aten flash kernel", lambda: flash(qt, kt, vt, 0.0, causal, False))):
            fn()
            host, dev = _cuda_time(fn, 10)
            row[name] = {"host_us": round(host, 1), "device_ms": round(dev, 3)}
    return row


def check_timing(ctx: Context) -> dict:
    """Host time per call vs the kernel's time, one rank, FLUX-like and Llama-like shapes:
    usp-hal (check every call / first call only) and the bare aten kernel."""
    rows: Dict[str, Any] = {}
    for label, shape in (("FLUX S=4096+512 H=24 D=128", (4608, 24, 24, False)),
                         ("Llama S=32768 H=32/8 D=128 causal", (32768, 32, 8, True))):
        try:
            rows[label] = _timing_row(*shape)
        except Exception as exc:
            rows[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    text = []
    for lab, r in rows.items():
        if "error" in r:
            text.append(f"{lab}: {r['error']}")
        else:
            text.append(f"{lab}: " + ", ".join(f"{n} host {x['host_us']} us / device {x['device_ms']} ms"
                                               for n, x in r.items()))
    bad = any("error" in r for r in rows.values())
    return {"status": "fail" if bad else "info", "detail": "; ".join(text), "data": rows}


def check_tflops(ctx: Context) -> dict:
    """The sdpa flash kernel's TFLOP/s (forward, not causal, B=1, H=16, D=128, bf16) at
    S = 8k, 32k, 128k, against the bf16 peak."""
    from usp_hal.backends.sdpa import cuda_ops
    flash = cuda_ops()[0]
    rows = {}
    h, d = 16, 128
    for s in (8192, 32768, 131072):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (_rand((1, h, s, d), torch.bfloat16, "cuda", gen) for _ in range(3))
        with torch.no_grad():
            flash(q, k, v, 0.0, False, False)
            n = 10 if s <= 32768 else 3
            _, ms = _cuda_time(functools.partial(flash, q, k, v, 0.0, False, False), n)
        tflops = 4 * s * s * h * d / (ms * 1e-3) / 1e12
        rows[f"S={s}"] = {"ms": round(ms, 3), "tflops": round(tflops, 1),
                          "of_peak": round(tflops / PEAK_BF16_TFLOPS, 3)}
        del q, k, v
    return {"status": "info", "detail": ", ".join(f"{k}: {v['tflops']} TFLOP/s ({100 * v['of_peak']:.0f}% of "
                                                  f"{PEAK_BF16_TFLOPS:.0f})" for k, v in rows.items()), "data": rows}


# ----------------------------------------------------------------------------- host reads (CPU)
def check_host_reads_meter(ctx: Context) -> dict:
    """The host-read meter catches a planted ``.item()`` (what the CPU stand-in relies on)."""
    from usp_hal.harness.hostreads import HostReadMeter
    x = torch.ones(4, device=ctx.device)
    with HostReadMeter() as m:
        x.sum().item()
    ok = m.reads["device"] == 1
    return {"status": "pass" if ok else "fail", "detail": f"counted {m.reads['device']} read(s) of one .item()"}


# ----------------------------------------------------------------------------- the list
def _checks() -> List[Check]:
    """In order; flex (which compiles a Triton kernel per call structure on CUDA) comes last, so
    a run cut by its time limit loses those first."""
    out = [Check("env/versions", "", "versions of Python, torch, triton, transformers, accelerate; the GPU", check_env)]
    for b in SDPA_BACKENDS:
        for dt in ("bf16", "fp16"):
            out.append(Check(f"kernel/sdpa-op/{b}/{dt}", "cuda",
                             f"torch SDPA restricted to {b}, {dt}: causal or not, GQA, odd lengths, Sq != Sk; "
                             "out, lse layout, dq/dk/dv vs float64", _sdpa_op_check(b, dt)))
    out.append(Check("kernel/sdpa-op/math/fp32-cpu", "", "torch SDPA math backend on this device, fp32 (the CPU "
                     "counterpart of the CUDA op checks)", _sdpa_op_check("math", "fp32")))

    def kernels(name: str, needs: str) -> None:
        out.append(Check(f"kernel/{name}/adapter", needs, f"usp-hal's {name} adapter on one rank, every dtype the "
                         "declarations accept here, causal or not, GQA, odd length; out, lse, grads vs float64",
                         _kernel_check(name, through_module=False)))
        out.append(Check(f"kernel/{name}/module", needs, f"{name} through LongContextAttention on one rank "
                         "(1 x 1 mesh), vs float64", _kernel_check(name, through_module=True)))
    kernels("sdpa", "")
    out.append(Check("kernel/sdpa/nonfinite", "", "a NaN and an inf in q: which kernels carry them into their rows "
                     "(facts), and LongContextAttention (1 x 1 mesh) makes exactly those rows non-finite, forward "
                     "only and with the lse and grads", check_nonfinite))
    kernels("sage_fp8", "cuda")
    for world, cases in MULTIRANK_CASES.items():
        out.append(Check(f"multirank/{world}/transport", "", f"the collectives usp-hal uses, on {world} gloo ranks "
                         "and this device's tensors (CUDA: p2p staged through host memory)", _transport_check(world)))
        for case in cases:
            out.append(Check(f"multirank/{world}/{case}", "", f"{case} on {world} ranks (one device, gloo): out "
                             "and dq/dk/dv vs float64", _multirank_check(world, case)))
    for op in ("gdn", "kda"):
        out.append(Check(f"multirank/2/fla-{op}-state-passing", "", f"fla 0.6.0's {op} kernel (CUDA: its Triton "
                         "chunk kernel; CPU: its torch reference) under usp-hal's state passing, Ring-2 zigzag "
                         "with packed documents: out and every input's gradient vs float64", _fla_check(op)))
    out.append(Check("host-reads/meter", "", "the host-read meter counts a planted .item()", check_host_reads_meter))
    for u, r in SYNC_MESHES:
        out.append(Check(f"sync/steady/U{u}R{r}", "", f"U{u} x R{r} (rank 0 of a fake group): steady forward+"
                         "backward with checks after the first call makes no synchronising call (CUDA: "
                         "set_sync_debug_mode('error'); CPU: no host read of tensor data)", _sync_check(u, r)))
    out.append(Check("cuda-graph/forward", "cuda", "one-rank forward captured in a CUDA graph and replayed equals "
                     "eager", check_cuda_graph))
    out.append(Check("timing/host-vs-kernel", "cuda", "host time per call vs kernel time: FLUX-like and Llama-like "
                     "shapes", check_timing))
    out.append(Check("timing/flash-tflops", "cuda", "sdpa flash TFLOP/s at S=8k, 32k, 128k vs the bf16 peak",
                     check_tflops))
    kernels("flex", "")
    out.append(Check("kernel/flex/mask-sinks", "", "flex through LongContextAttention: a block mask ending "
                     "mid-tile, sinks, both with causal; lse, grads (CUDA: compiled, with backward)",
                     check_flex_features))
    return out


CHECKS = _checks()


def _write(ctx: Context, rows: List[dict], seconds: float) -> dict:
    report = {"device": ctx.device, "dry_run": ctx.dry_run, "seconds": round(seconds, 1),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "checks": rows}
    with open(os.path.join(ctx.out, "device-check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(ctx.out, "device-check.txt"), "w") as f:
        f.write(format_table(rows) + "\n")
    return report


def run_checks(ctx: Context, only: Optional[str] = None) -> List[dict]:
    """Run the selected checks in order; the report is rewritten after each one, so a run
    stopped by its time limit still leaves what finished."""
    t_all = time.perf_counter()
    for c in CHECKS:
        if only and not any(fnmatch.fnmatch(c.name, p) for p in only.split(",")):
            continue
        row: Dict[str, Any] = {"name": c.name, "needs": c.needs or "any", "what": c.what}
        t0 = time.perf_counter()
        if c.needs == "cuda" and not ctx.cuda:
            row.update(status="skip", detail="needs CUDA" + (" (--dry-run)" if ctx.dry_run else ""))
        else:
            try:
                row.update(c.fn(ctx))
            except Skip as exc:
                row.update(status="skip", detail=str(exc))
            except Exception as exc:
                row.update(status="fail", detail=f"{type(exc).__name__}: {exc}"[:500],
                           traceback=traceback.format_exc()[-2000:])
        row["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"{row['status'].upper():5s} {c.name} ({row['seconds']:.1f} s): {row.get('detail', '')[:300]}",
              flush=True)
        ctx.results.append(row)
        _write(ctx, ctx.results, time.perf_counter() - t_all)
    close_pools()
    return ctx.results


def format_table(rows: List[dict]) -> str:
    w = max([len(r["name"]) for r in rows] + [5])
    lines = [f"{'check':{w}s}  {'status':6s} {'s':>6s}  detail", "-" * (w + 40)]
    for r in rows:
        lines.append(f"{r['name']:{w}s}  {r['status']:6s} {r.get('seconds', 0):6.1f}  {r.get('detail', '')}")
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(lines)


def merge_steps(out: str, steps_path: str) -> int:
    """Fold the shell steps (``steps.tsv``: name, status, detail) into the report; print the
    table; 1 when anything failed."""
    path = os.path.join(out, "device-check.json")
    report: Dict[str, Any] = {"checks": []}
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    else:
        report["checks"].append({"name": "checks", "status": "fail", "detail": "the checks wrote no report"})
    steps = []
    with open(steps_path) as f:
        for line in f:
            if line.strip():
                name, status, detail = (line.rstrip("\n").split("\t", 2) + ["", ""])[:3]
                steps.append({"name": f"step/{name}", "needs": "any", "status": status, "detail": detail,
                              "seconds": 0.0})
    rows = steps + [r for r in report["checks"] if not r["name"].startswith("step/")]
    report["checks"] = rows
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    table = format_table(rows)
    with open(os.path.join(out, "device-check.txt"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python ci/device_check.py",
                                 description="the first-GPU device check (see ci/device-check.sh)")
    ap.add_argument("outdir", nargs="?", default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="run on the CPU; checks that need CUDA are listed as skipped")
    ap.add_argument("--only", default=None, help="comma-separated name patterns (fnmatch), e.g. 'kernel/*,sync/*'")
    ap.add_argument("--list", action="store_true", help="print every check's name, what it needs and what it does")
    ap.add_argument("--no-summary", action="store_true", help="do not print the table at the end")
    ap.add_argument("--merge-steps", metavar="TSV", default=None,
                    help="fold ci/device-check.sh's step outcomes into OUTDIR's report and print the table")
    a = ap.parse_args(argv)
    if a.list:
        for c in CHECKS:
            print(f"{c.name:32s} {c.needs or 'any':5s} {c.what}")
        return 0
    if a.outdir is None:
        ap.error("OUTDIR is required")
    os.makedirs(a.outdir, exist_ok=True)
    if a.merge_steps:
        return merge_steps(a.outdir, a.merge_steps)
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("no CUDA device here: running as --dry-run", flush=True)
    ctx = Context(device="cuda" if cuda else "cpu", out=a.outdir, dry_run=not cuda)
    rows = run_checks(ctx, a.only)
    if not a.no_summary:
        print("\n" + format_table(rows))
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    # the rank processes import the task functions by module name: run them from the module, not __main__
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import device_check as _named
    sys.exit(_named.main())
