"""Where each backend and feature was verified, as data (rendered into docs/backends.md).

Tiers, weakest first:

* ``stand-in``: the adapter ran against a stand-in package on the CPU that copies the real
  kernel's API and checks (``tests/contract/``): proves the adapter, not the kernel;
* ``interpreter``: the real Triton kernel ran under Triton's interpreter on CPU tensors
  (``tests/real/``, ``usp-hal probe --verify --interpret``): proves the kernel's Python API
  and arithmetic as the adapter drives it, not the GPU;
* ``cpu``: the real kernel on the CPU device itself (the suite);
* ``device``: the real kernel on a real accelerator, by ``ci/device-check.sh``; each entry of
  :data:`DEVICE_RUNS` names the machine, the versions and the date.  Nothing is counted as
  verified on a device before such a run is recorded here.

A feature the backend's declarations refuse on a device shows as ``refused`` (decided by
its own ``not_supported_reasons``, as the matrix is), whatever is listed here.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

#: features in display order: the matrix flags, then packed documents and the multi-rank module
FEATURES = ("fwd", "bwd", "ring", "causal", "window", "softcap", "gqa", "packed", "module")

_ALL = FEATURES

#: {backend: {device type: {feature: tiers}}}; a feature left out has no evidence on that device
VERIFIED: Dict[str, Dict[str, Dict[str, Tuple[str, ...]]]] = {
    # the CPU ops themselves: tests/test_sdpa_backend.py, the multi-rank suite; CUDA/ROCm ops:
    # stand-ins of the aten flash/efficient ops (tests/contract/test_sdpa_cuda.py,
    # test_usp_adapters.py)
    "sdpa": {"cpu": {f: ("cpu",) for f in _ALL},
             "cuda": {f: ("stand-in",) for f in _ALL}, "rocm": {f: ("stand-in",) for f in _ALL}},
    # tests/contract/test_fa2.py, test_varlen_adapters.py; tests/real: the Triton AMD build
    # (fp16; window and softcap refused there)
    "fa2": {"cuda": {f: ("stand-in",) for f in _ALL},
            "rocm": {**{f: ("stand-in", "interpreter") for f in ("fwd", "bwd", "ring", "causal", "gqa", "packed",
                                                                   "module")},
                     "window": ("stand-in",), "softcap": ("stand-in",)}},
    "fa3": {"cuda": {f: ("stand-in",) for f in _ALL}},
    "fa4": {"cuda": {f: ("stand-in",) for f in _ALL}},
    # the sage kernel 1.0.6 under the interpreter: forward, causal, GQA, LongContextAttention
    # (1 rank, Ulysses-2); the v2 API (lse) on stand-ins only
    "sage_fp8": {"cuda": {**{f: ("stand-in",) for f in _ALL},
                          **{f: ("stand-in", "interpreter") for f in ("fwd", "causal", "gqa", "module")}}},
    "flashinfer": {"cuda": {f: ("stand-in",) for f in _ALL}},
    "npu": {"npu": {f: ("stand-in",) for f in _ALL}},
    "xpu": {"xpu": {f: ("stand-in",) for f in _ALL}},
    # CPU: torch's uncompiled flex itself (tests/test_flex_backend.py); CUDA: the compiled
    # kernels never ran, the backward runs on torch's unfused flex with its CPU refusal lifted
    "flex": {"cpu": {f: ("cpu",) for f in _ALL}, "cuda": {f: ("stand-in",) for f in _ALL}},
    # plain torch: each feature against float64 on the CPU, ring-merged blocks, USP on 2 ranks, packed
    # documents on a ring (tests/test_portable_backend.py); never run on an accelerator
    "portable": {"cpu": {f: ("cpu",) for f in _ALL}},
}

#: real-device runs of ci/device-check.sh: {"date", "device", "versions", "report",
#: "verified": {backend: [features]}}.  Empty until the check has run on a GPU.
DEVICE_RUNS: List[dict] = []


def tiers(backend: str, device: str, feature: str) -> Tuple[str, ...]:
    got = list(VERIFIED.get(backend, {}).get(device, {}).get(feature, ()))
    for run in DEVICE_RUNS:
        if run.get("device_type") == device and feature in run.get("verified", {}).get(backend, ()):
            got.append("device")
    return tuple(got)


def device_runs_text() -> List[str]:
    if not DEVICE_RUNS:
        return ["No real device yet: `ci/device-check.sh` has not run on an accelerator, so no cell says "
                "`device`. Its CPU dry run (`ci/device-check.sh OUT --dry-run`) runs in CI."]
    return [f"- {r['date']}: {r['device']} ({r['versions']}), report {r['report']}" for r in DEVICE_RUNS]
