"""Functions that run on every rank of a WorkerPool (tests/mp.py) for the adapter tests
through ``usp_hal.LongContextAttention``.

Each function installs a stand-in kernel *inside the rank process* (a package written to a
temporary site directory, or a substituted op table), emulates the adapter's device with
``usp_hal.dispatch.platform.emulate`` and runs the whole USP core on CPU tensors and gloo, comparing
with the float64 single-process reference.  Everything is undone before it returns, so
the reused rank processes stay clean.  ``standin`` is a small picklable spec:
``{"kind": "fa2", "arg": "2.8.3"}``, ``{"kind": "xpu"}``, ... (see :func:`installed`).
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

import usp_hal
from tests import dist_cases
from tests.mp import environ
from usp_hal.dispatch import platform
from usp_hal.dispatch.reference import reference_attention
from usp_hal.harness import CommMeter

from .standin import standin_installed


def _package(kind: str, arg):
    from . import standins_fa as fa
    from . import standins_misc as misc
    if kind == "fa2":
        return dict(dist=fa.FA2_DIST, version=arg, files=fa.fa2_files(arg))
    if kind == "fa2-triton-amd":        # the Triton AMD build: no flash_attn_2_cuda (see installed())
        files = fa.fa2_files(arg, with_extension=False, triton_amd=True)
        if importlib.util.find_spec("triton") is None:
            # availability asks for triton; the stand-in kernels need none (an empty marker module,
            # only where no real triton is installed)
            files["triton/__init__.py"] = "# stand-in marker: the Triton AMD stand-in kernels import nothing from it\n"
        return dict(dist=fa.FA2_DIST, version=arg, files=files)
    if kind == "fa3":
        return dict(dist=fa.FA3_DIST, version="3.0.0b1", files=fa.fa3_files(arg))
    if kind == "sage":
        return dict(dist="sageattention", version=arg, files=misc.sage_files(arg))
    if kind == "flashinfer":
        return dict(dist="flashinfer-python", version=arg, files=misc.flashinfer_files())
    if kind == "npu":
        return dict(dist="torch-npu", version=arg, files=misc.npu_files(5))
    return None


@contextlib.contextmanager
def _ops(module, attr, table):
    old = getattr(module, attr)
    setattr(module, attr, lambda: table)
    try:
        yield
    finally:
        setattr(module, attr, old)


TRITON_AMD_ENV = {"FLASH_ATTENTION_TRITON_AMD_ENABLE": "TRUE"}


@contextlib.contextmanager
def installed(standin: dict):
    """The stand-in kernel of ``standin`` for the duration of the block."""
    kind = standin["kind"]
    pkg = _package(kind, standin.get("arg"))
    if pkg is not None:
        with standin_installed(**pkg), environ(TRITON_AMD_ENV if kind == "fa2-triton-amd" else {}):
            yield
    elif kind == "xpu":
        from usp_hal.backends import xpu

        from .standins_misc import XPUFlashStandin
        s = XPUFlashStandin()
        with _ops(xpu, "flash_ops", (s.forward, s.backward)):
            yield
    elif kind == "sdpa-cuda":
        from usp_hal.backends import sdpa

        from .standins_sdpa import CudaSDPAStandin
        s = CudaSDPAStandin()
        with _ops(sdpa, "cuda_ops", (s.flash, s.efficient, s.efficient_backward)):
            yield
    else:
        raise ValueError(f"unknown stand-in {kind!r}")


def adapter_case(standin: dict, emulate: dict, attn_type: str, **case):
    """``tests.dist_cases.usp_case`` (sharded USP attention vs the float64 reference, forward
    and optionally gradients) with ``attn_type`` running on its stand-in.  Returns the
    normalised errors (<= 1 passes) and the backend that ran."""
    with installed(standin), platform.emulate(**emulate):
        errs = dist_cases.usp_case(attn_type=attn_type, **case)
    return errs


_COLLECTIVES = ("all_to_all_single", "batch_isend_irecv", "all_gather_into_tensor", "all_gather_single", "broadcast")


class _DataMeter(CommMeter):
    """Counts the calls that carry data: the agreement's all-gathers (int64 metadata, the
    uint8 bytes of the refusal messages) are left out whichever function carries them
    (all_gather_single from torch 2.13, all_gather_into_tensor before)."""

    def _wrap(self, name, orig):
        inner = super()._wrap(name, orig)

        def wrapped(*args, **kwargs):
            t = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input", kwargs.get("input_tensor")))
            if name.startswith("all_gather") and getattr(t, "dtype", None) in (torch.int64, torch.uint8):
                self.calls[name] -= 1          # inner counts it once more
            return inner(*args, **kwargs)
        return wrapped


def refused_before_collectives(standin: dict, emulate: dict, attn_type: str, U=1, R=1, grad=False,
                               return_lse=False, S=8, H=2, D=64, dtype=torch.float16, causal=True):
    """A call the backend cannot serve must fail on every rank before any data collective
    (the metadata all-gather is the only exchange allowed).  Returns the error text (or None)
    and the count of data collectives issued."""
    with installed(standin), platform.emulate(**emulate):
        mesh = dist_cases.get_mesh(U, R)
        n = mesh.sp_size
        g = torch.Generator().manual_seed(0)
        x = [torch.randn(1, S // n, H, D, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]
        attn = usp_hal.LongContextAttention(attn_type=attn_type, mesh=mesh)
        with _DataMeter(_COLLECTIVES) as meter:
            try:
                attn(*x, causal=causal, return_lse=return_lse)
                error = None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
    counts = dict(meter.calls)
    return {"error": error, "counts": counts}


def strided_query_case(U=1, R=2, attn_type="sdpa", standin=None, emulate=None, dtype="fp32", causal=True,
                       B=2, S=16, H=2, D=8, seed=0):
    """Each rank's query is a view with head-dim stride 2 (``buf[..., ::2]``), key/value a
    permuted (non-contiguous) view: forward and gradients through LongContextAttention must
    equal the float64 reference (the gradient lands in the strided buffer)."""
    ctx = contextlib.ExitStack()
    with ctx:
        if standin is not None:
            ctx.enter_context(installed(standin))
        if emulate is not None:
            ctx.enter_context(platform.emulate(**emulate))
        mesh = dist_cases.get_mesh(U, R)
        dt = dist_cases.DTYPES[dtype]
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, S, H, D, generator=g).to(dt)
        k = torch.randn(B, S, H, D, generator=g).to(dt)
        v = torch.randn(B, S, H, D, generator=g).to(dt)
        dout = torch.randn(B, S, H, D, generator=g).to(dt)
        qr, kr, vr = (x.to(torch.float64).requires_grad_() for x in (q, k, v))
        ro, _ = reference_attention(qr, kr, vr, causal=causal)
        rq, rk, rv = torch.autograd.grad(ro, (qr, kr, vr), dout.double())

        def sh(x):
            return usp_hal.shard(x, layout="basic", mesh=mesh)

        ql = sh(q)
        buf = torch.zeros(*ql.shape[:-1], 2 * D, dtype=dt)
        buf[..., ::2] = ql
        buf.requires_grad_()
        q_view = buf[..., ::2]
        assert q_view.stride(-1) == 2
        k_base = sh(k).permute(1, 0, 2, 3).contiguous().requires_grad_()   # sequence-major memory
        v_base = sh(v).permute(1, 0, 2, 3).contiguous().requires_grad_()
        k_view, v_view = k_base.permute(1, 0, 2, 3), v_base.permute(1, 0, 2, 3)
        assert not k_view.is_contiguous()
        attn = usp_hal.LongContextAttention(attn_type=attn_type, mesh=mesh)
        out = attn(q_view, k_view, v_view, causal=causal)
        out.backward(sh(dout))
        errs = {"out": dist_cases._err(out, sh(ro), dt),
                "dq": dist_cases._err(buf.grad[..., ::2], sh(rq), dt),
                "dk": dist_cases._err(k_base.grad.permute(1, 0, 2, 3), sh(rk), dt),
                "dv": dist_cases._err(v_base.grad.permute(1, 0, 2, 3), sh(rv), dt)}
        errs["unused_columns_grad"] = float(buf.grad[..., 1::2].abs().max())
    return errs


def packed_adapter_case(standin: dict, emulate: dict, attn_type: str, **case):
    """``tests.dist_varlen.packed_case`` (packed documents through LongContextAttention vs
    float64 per-document attention) with ``attn_type`` on its stand-in; also returns the
    stand-in's record of varlen kernel calls on this rank."""
    import importlib

    from tests import dist_varlen
    with installed(standin), platform.emulate(**emulate):
        ext = importlib.import_module("flash_attn_2_cuda" if standin["kind"] == "fa2" else "flash_attn_3._C")
        ext.VARLEN_CALLS.clear()
        errors = dist_varlen.packed_case(attn_type=attn_type, **case)
        calls = [tuple(c) for c in ext.VARLEN_CALLS]
    return {"errors": errors, "varlen_calls": calls}
