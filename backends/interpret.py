"""Real Triton kernels on the CPU, under Triton's interpreter (an explicit choice only).

``TRITON_INTERPRET=1`` makes Triton execute ``@triton.jit`` kernels in Python on CPU
tensors.  Two of the adapters' kernels are Triton code and run that way: SageAttention
1.0.6 (``sageattention``) and flash-attn's Triton AMD build (``flash-attn`` installed with
``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE``).  That checks their API and their arithmetic
through the adapters and the USP core on a machine without the device; it says nothing
about GPU races, tensor-core rounding or what masked loads return on the hardware.

Nothing here is ever chosen silently: the test tier (``tests/real/``) and
``usp-hal probe --verify --interpret`` ask for it, in processes of their own, because the
variables must be set before ``triton`` (and ``flash_attn``) are first imported.  What this
module adds to the real packages, only in such a process:

* flash-attn's ops are ``torch.library.custom_op(..., device_types="cuda")``: the same
  Python functions are registered for ``"cpu"`` too (:func:`prepare`).
* ``sageattention.sageattn`` starts with ``assert q.is_cuda``: the query is handed over as a
  view whose ``is_cuda`` reads True (every operation on it gives a plain CPU tensor); the
  rest of the real function runs unchanged.
* The adapters see the device they were written for through
  :func:`usp_hal.dispatch.platform.emulate` (:data:`EMULATION`).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Any, Dict, Optional

#: the variables an interpreted process needs, before its first ``import triton``
ENV = {"TRITON_INTERPRET": "1", "FLASH_ATTENTION_TRITON_AMD_ENABLE": "TRUE"}

#: backend -> the device its kernel is emulated as (the Triton AMD build is what runs on ROCm)
EMULATION: Dict[str, Dict[str, Any]] = {
    "sage_fp8": {"device_type": "cuda", "compute_capability": (8, 0)},
    "fa2": {"device_type": "rocm"},
}

#: backend -> (distribution, triton versions its kernels were run under here, tried and failing)
TRITON_RANGES = {
    # 3.6.0: the interpreter fails both (InterpreterError "only 0-dimensional arrays can be converted")
    "sage_fp8": ("sageattention", ">=3.7.1,<3.10"),
    # 3.9.0: its autotuner rejects keys that are not kernel arguments (flash_attn_triton_amd/
    # bwd_prefill_onekernel.py, imported by interface_fa.py), so flash_attn_interface cannot be imported
    "fa2": ("flash-attn", ">=3.7.1,<3.9"),
}

#: dtypes whose arithmetic the interpreter gets right for each kernel: triton 3.7-3.9 compute a
#: bf16 tl.dot on the raw 16-bit storage (errors ~1e10); sage converts V to fp16 and Q/K to int8
#: itself, so its bf16 calls are fine, flash-attn's are not
DTYPES = {"sage_fp8": ("fp16", "bf16"), "fa2": ("fp16",)}


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(name: str) -> str:
    """Why backend ``name`` cannot run under the interpreter here ('' when it can).  Metadata
    and find_spec only: nothing is imported."""
    if name not in TRITON_RANGES:
        return f"{name}: no Triton kernel to interpret (only {', '.join(sorted(TRITON_RANGES))})"
    dist, spec = TRITON_RANGES[name]
    triton = _version("triton")
    if triton is None or importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install --no-deps 'triton" + spec + "')"
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    if Version(Version(triton).public) not in SpecifierSet(spec):
        return f"triton {triton} is outside the versions {name}'s kernels run under the interpreter ({spec})"
    if _version(dist) is None:
        return f"{dist} is not installed"
    if name == "fa2":
        from usp_hal.backends import fa2
        iface = fa2.fa2_interface_path()
        amd = os.path.join(os.path.dirname(iface), fa2.TRITON_AMD_DIR, "interface_fa.py") if iface else None
        if amd is None or not os.path.isfile(amd):
            return "flash-attn is installed without its Triton AMD backend (flash_attn/flash_attn_triton_amd)"
        if importlib.util.find_spec("einops") is None:
            return "flash-attn's Triton AMD backend imports einops, which is not installed"
    return ""


def check_process() -> None:
    """Raise unless this process can interpret: the variables set, and set before triton and
    flash_attn were imported (afterwards the interpreter cannot be switched on)."""
    wrong = [f"{k}={v}" for k, v in ENV.items() if os.environ.get(k) != v]
    if wrong:
        raise RuntimeError("the Triton interpreter needs " + ", ".join(wrong) + " in the environment before the "
                           "first import of triton: start a process with them (usp_hal.backends.interpret.ENV)")
    triton = sys.modules.get("triton")
    if triton is not None and not _interpreting(triton):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: use a fresh process")


def _interpreting(triton) -> bool:
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    flag = getattr(knobs, "interpret", None)
    return True if flag is None else bool(flag)


def prepare(name: str) -> None:
    """Make backend ``name``'s real package callable on CPU tensors in this (interpreting)
    process.  Idempotent."""
    check_process()
    if name == "fa2":
        _prepare_fa2()
    elif name == "sage_fp8":
        _prepare_sage()
    else:
        raise ValueError(f"{name}: no Triton kernel to interpret")


def _prepare_fa2() -> None:
    iface = importlib.import_module("flash_attn.flash_attn_interface")
    gpu = getattr(iface, "flash_attn_gpu", None)
    if "flash_attn_triton_amd" not in getattr(gpu, "__name__", ""):
        raise RuntimeError("flash_attn_interface did not load the Triton AMD kernels "
                           f"(FLASH_ATTENTION_TRITON_AMD_ENABLE={os.environ.get('FLASH_ATTENTION_TRITON_AMD_ENABLE')})")
    if getattr(iface, "_usp_hal_cpu_registered", False):
        return
    from flash_attn.flash_attn_triton_amd import utils as amd_utils
    need_alibi = amd_utils.MetaData.need_alibi

    def need_alibi_on_cpu(self, alibi_slopes, batch, nheads):
        # utils.py MetaData.need_alibi starts with ``assert alibi_slopes.is_cuda``
        return need_alibi(self, alibi_slopes.as_subclass(_reports_cuda()), batch, nheads)
    amd_utils.MetaData.need_alibi = need_alibi_on_cpu
    for fn_name in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                    "_flash_attn_varlen_backward"):
        op = getattr(iface, fn_name)
        # the custom op was declared for "cuda" only; the same Python function serves "cpu"
        op.register_kernel("cpu")(op._init_fn)
    iface.__dict__["_usp_hal_cpu_registered"] = True


_REPORTS_CUDA: list = []


def _reports_cuda():
    """A torch.Tensor subclass whose ``is_cuda`` is True; operations on it give plain tensors."""
    if not _REPORTS_CUDA:
        import torch

        class ReportsCuda(torch.Tensor):
            is_cuda = property(lambda self: True)
            __torch_function__ = torch._C._disabled_torch_function_impl
        _REPORTS_CUDA.append(ReportsCuda)
    return _REPORTS_CUDA[0]


def _prepare_sage() -> None:
    import sageattention
    if getattr(sageattention, "_usp_hal_interpreted", False):
        return
    real = sageattention.sageattn
    cls = _reports_cuda()

    def sageattn(q, k, v, *args, **kwargs):
        return real(q.as_subclass(cls), k, v, *args, **kwargs)

    sageattn.__wrapped__ = real  # type: ignore[attr-defined]
    sageattention.sageattn = sageattn
    sageattention._usp_hal_interpreted = True
