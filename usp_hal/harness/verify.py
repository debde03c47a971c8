"""Verification against the float64 reference, and what the probe reports.

Features (:data:`DECLARED`: their flags :data:`FEATURES`, the request changes that exercise
them, their rows in the backend table) are decided by each backend's own
``not_supported_reasons`` (:func:`supported_features`, :func:`feature_change`);
:func:`verify_backend` runs every available backend once on a device for each dtype it
declares (small shapes; causal and not; GQA and each feature with a case of its own when
declared) and compares ``out``, ``lse`` and, for backends with a backward,
``dq``/``dk``/``dv`` with :func:`usp_hal.dispatch.reference.reference_attention`, using the
per-dtype tolerances of :mod:`usp_hal.dispatch.reference` (or a lossy backend's own).
:func:`compare` is the one tolerance check, shared with ``usp-hal run``/``bench`` and the
tests.  :func:`collect` gathers what ``usp-hal probe`` prints: the torch build, the
devices, the distributed backends, every registered backend's availability (with the exact
reason) and declared capabilities, and the verification results.

``usp-hal probe``, the CI matrix (``usp-hal matrix``) and the tests all use these
helpers, so "what a backend is tested for" has one definition.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from .. import __version__
from ..dispatch import platform as _platform
from ..dispatch.capabilities import AttnRequest, KernelCall, capability_row, dtype_name, parse_dtype
from ..dispatch.reference import TOLERANCES, reference_attention
from ..dispatch.registry import REGISTRY

# ----------------------------------------------------------------------------- features
VERIFY_BATCH = 2
VERIFY_SEQLEN = 32
VERIFY_HEADS = 4
VERIFY_KV_HEADS = 2          # the GQA case: two query heads per key/value head
VERIFY_WINDOW = (6, 2)       # (left, right); narrower than the sequence on both sides
VERIFY_LEFT_WINDOW = (6, 0)  # causal sliding window, for kernels with a left bound only
VERIFY_SOFTCAP = 1.0         # small enough that the cap changes the scores noticeably
FP8_RMS_BUDGET = 0.05       # a lossy (fp8 wire format) result: RMS error <= 5% of RMS(reference)
# first head dim (in this order) that a backend's declarations accept is used for checks
HEAD_DIM_CANDIDATES = (64, 128, 32, 96, 80, 16, 256, 8)


@dataclass(frozen=True)
class Feature:
    """A feature a backend may support, and how it is tested.

    ``variants``: request changes that use it, in order of preference; the backend supports
    it when its ``not_supported_reasons`` accepts one of them, and the first accepted one is
    what gets verified.  ``texts``: what the backend table (docs/backends.md) says for each
    variant when it is the first accepted ("yes" where not given; a function of the backend
    class for a text that depends on its declarations); "no" when none is.  ``needs``: the
    change the feature only applies to and the table's text where that is refused.
    ``label``: its row in the table.  ``column``: a flag of the CI matrix, the probe and
    :func:`verify_backend` (else the table alone shows it).  ``own_case``: verification runs
    a case of its own for it (causal and GQA are combined with the others instead)."""

    name: str
    label: str
    variants: Tuple[dict, ...]
    texts: Tuple[Any, ...] = ()
    needs: Optional[Tuple[dict, str]] = None
    column: bool = True
    own_case: bool = False


def _determinism(backend) -> str:
    return "yes" if backend.IS_DETERMINISTIC else "on request (deterministic=True)"


#: Every feature a backend is tested for or documented with, in display order: adding one here
#: adds its row to docs/backends.md and, with ``column``, its flag to the CI matrix and the probe.
DECLARED: Tuple[Feature, ...] = (
    Feature("fwd", "forward", ({},)),
    Feature("bwd", "backward", ({"needs_grad": True},)),
    Feature("ring", "ring (returns lse)", ({"needs_lse": True},)),
    Feature("causal", "causal", ({"causal": True},)),
    Feature("window", "sliding window", ({"window": VERIFY_WINDOW}, {"window": VERIFY_LEFT_WINDOW, "causal": True}),
            texts=("yes", "left bound only (causal)"), own_case=True),
    Feature("softcap", "softcap", ({"softcap": VERIFY_SOFTCAP},), own_case=True),
    Feature("alibi", "alibi", ({"alibi": True},), column=False),
    Feature("dropout", "dropout", ({"dropout_p": 0.1},), column=False),
    Feature("gqa", "GQA/MQA", ({"num_kv_heads": VERIFY_KV_HEADS},)),
    Feature("deterministic", "deterministic backward", ({"needs_grad": True, "deterministic": True},),
            texts=(_determinism,), needs=({"needs_grad": True}, "n/a (no backward)"), column=False),
)

#: Feature flags a backend is tested for, in display order (the CI matrix's columns).
FEATURES = tuple(f.name for f in DECLARED if f.column)

#: The flags that are options of a call or of its shapes rather than a way of running it
#: (forward, backward, ring): the probe shows each as the capability declared under its name.
OPTION_FEATURES = tuple(f for f in FEATURES if f not in ("fwd", "bwd", "ring"))

#: feature -> request changes that exercise it, in order of preference (:attr:`Feature.variants`).
FEATURE_VARIANTS = {f.name: f.variants for f in DECLARED}


def feature_change(backend, base: AttnRequest, feature: str) -> Optional[dict]:
    """The first variant of ``feature`` that ``backend`` accepts on top of ``base``, or None."""
    try:
        variants = FEATURE_VARIANTS[feature]
    except KeyError:
        raise ValueError(f"unknown feature {feature!r}; valid: {', '.join(FEATURE_VARIANTS)}") from None
    for change in variants:
        if not backend.not_supported_reasons(base.with_(**change)):
            return dict(change)
    return None


def base_request(backend, device_type: str, dtype: torch.dtype,
                 compute_capability: Optional[tuple] = None) -> AttnRequest:
    """A plain forward request for this device/dtype with a head dim the backend declares.

    The head dim is the first of :data:`HEAD_DIM_CANDIDATES` the declarations accept; when
    none is accepted (or something else is refused) the returned request still carries the
    first candidate, so ``not_supported_reasons`` on it explains the refusal.
    """
    base = AttnRequest(dtype=dtype, device_type=device_type, num_heads=VERIFY_HEADS,
                       compute_capability=tuple(compute_capability) if compute_capability else None,
                       head_dim=HEAD_DIM_CANDIDATES[0])
    for hd in HEAD_DIM_CANDIDATES:
        req = base.with_(head_dim=hd)
        if not backend.not_supported_reasons(req):
            return req
    return base


def supported_features(backend, base: AttnRequest) -> dict:
    """{feature: bool} for ``base``, decided by the backend's own ``not_supported_reasons``."""
    return {f: feature_change(backend, base, f) is not None for f in FEATURES}


def tolerances_for(backend, dtype: torch.dtype) -> tuple:
    """(atol, rtol) for verifying ``backend`` in ``dtype``: the reference's per-dtype
    tolerances, unless the backend declares its own for a lossy kernel
    (``LOSSY_TOLERANCES = {dtype: (atol, rtol)}``)."""
    own = getattr(backend, "LOSSY_TOLERANCES", None) or {}
    return tuple(own.get(dtype, TOLERANCES[dtype]))


# ----------------------------------------------------------------------------- verify
def _cases(backend, base: AttnRequest, use: dict) -> list:
    """(case name, request changes) for the enabled features; always a plain case first."""
    cases: Any = [("plain", {})]
    causal = feature_change(backend, base, "causal") if use.get("causal") else None
    if causal is not None:
        cases.append(("causal", causal))
    if use.get("gqa"):
        gqa = feature_change(backend, base, "gqa")
        if gqa is not None:
            change = {**gqa, **(causal or {})}
            cases.append(("gqa-causal" if change.get("causal") else "gqa", change))
    for feature in (f.name for f in DECLARED if f.own_case and f.column):
        fchange = feature_change(backend, base, feature) if use.get(feature) else None
        if fchange is not None:
            cases.append((feature + ("-causal" if fchange.get("causal") else ""), fchange))
    return cases


def compare(got, ref, atol: float, rtol: float, lossy: bool = False) -> dict:
    """``got`` against ``ref`` under the tolerance ``|err| <= atol + rtol * |ref|``: the one
    comparator of the probe, ``usp-hal run``/``bench`` and the tests.

    Returns ``{"max_abs", "worst", "rms_rel", "max_rel", "ok", "problem"}``.  ``worst`` is
    the largest ``|err| / (atol + rtol * |ref|)`` (<= 1 passes); with ``lossy`` (the fp8 wire
    format) it is RMS(err)/RMS(ref) over :data:`FP8_RMS_BUDGET` instead.  ``rms_rel`` and
    ``max_rel``: RMS(err)/RMS(ref) and max|err|/max|ref|.  Infinities of the same sign are
    equal (the lse of a row that sees no key), NaN is an infinite error.  A missing tensor or
    a different shape fails, with ``max_abs`` None and the reason in ``problem``.
    """
    fail = {"max_abs": None, "worst": math.inf, "rms_rel": None, "max_rel": None, "ok": False}
    if got is None:
        return {**fail, "problem": "missing"}
    if tuple(got.shape) != tuple(ref.shape):
        return {**fail, "problem": f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}"}
    r = ref.detach().to(torch.float64)
    g = got.detach().to(r.device, torch.float64)
    same_inf = torch.isinf(g) & torch.isinf(r) & (torch.sign(g) == torch.sign(r))
    diff = torch.nan_to_num((g - r).abs().masked_fill(same_inf, 0.0), nan=math.inf)
    if not diff.numel():
        return {"max_abs": 0.0, "worst": 0.0, "rms_rel": 0.0, "max_rel": 0.0, "ok": True, "problem": ""}
    r = r.masked_fill(torch.isinf(r), 0.0)
    rms_rel = float(diff.pow(2).mean().sqrt()) / (float(r.pow(2).mean().sqrt()) or 1.0)
    max_rel = float(diff.max()) / (float(r.abs().max()) or 1.0)
    worst = rms_rel / FP8_RMS_BUDGET if lossy else float((diff / (atol + rtol * r.abs())).max())
    ok = worst <= 1.0
    return {"max_abs": float(diff.max()), "worst": worst, "rms_rel": rms_rel, "max_rel": max_rel, "ok": ok,
            "problem": "" if ok else "exceeds tolerance"}


def _expected_lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def verify_case(backend, device_type: str, dtype: torch.dtype, head_dim: int, call: KernelCall, *,
                num_kv_heads: Optional[int] = None, seed: int = 0, tolerance: Optional[tuple] = None) -> dict:
    """Run ``backend`` once on ``device_type`` with the options of ``call`` (its lse checked
    when ``call.needs_lse``, its gradients when ``call.needs_grad``) and compare with the
    float64 reference.

    Returns ``{"errors": {name: max abs error}, "ok": bool, "problems": [text]}``; a kernel
    that raises gives ``ok=False`` with the exception as the problem.  ``tolerance``
    defaults to :func:`tolerances_for` the backend.
    """
    check_lse, check_grad = call.needs_lse, call.needs_grad
    atol, rtol = tolerance if tolerance is not None else tolerances_for(backend, dtype)
    b, s, h = VERIFY_BATCH, VERIFY_SEQLEN, VERIFY_HEADS
    hkv = h if num_kv_heads is None else num_kv_heads
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, heads, head_dim, generator=gen).to(dtype) for heads in (h, hkv, hkv))
    dout = torch.randn(b, s, h, head_dim, generator=gen).to(dtype)
    call = call.with_(scale=call.scale_for(head_dim))

    qr, kr, vr = (x.to(torch.float64).requires_grad_(check_grad) for x in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, softmax_scale=call.scale, causal=call.causal,
                                           window=call.window, softcap=call.softcap)
    checks = _Checks(_references(ref_out, ref_lse, dout, (qr, kr, vr), check_grad), atol, rtol, dtype)
    dev = _tensor_device(device_type)

    def run():
        kernel = backend()
        qd, kd, vd, dod = (x.to(dev) for x in (q, k, v, dout))
        out, lse = kernel.forward(qd, kd, vd, call)
        checks.outputs(out, lse, check_lse)
        if check_grad:
            checks.grads(kernel.backward(dod, qd, kd, vd, out, lse, call))
    return checks.run(run)


def _tensor_device(device_type: str) -> torch.device:
    """Where the case's tensors live: the device itself, or the CPU while it is emulated
    (:func:`usp_hal.dispatch.platform.emulate`: CPU tensors stand for the device)."""
    em = _platform.emulated()
    if em is not None and em.device_type == device_type:
        return torch.device("cpu")
    return torch.device(_platform.torch_device_name(device_type))


def _references(ref_out, ref_lse, dout, leaves, check_grad: bool) -> dict:
    """The float64 reference results (and, with ``check_grad``, the gradients of ``leaves``)."""
    if check_grad:
        ref_out.backward(dout.to(torch.float64))
    refs: Dict[str, Any] = {"out": ref_out.detach(), "lse": ref_lse.detach()}
    if check_grad:
        refs.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    return refs


class _Checks:
    """The comparisons of one verification against its references: ``{"errors": {name: max
    abs error}, "ok", "problems": [text]}``; a kernel that raises is a failed result."""

    def __init__(self, refs: dict, atol: float, rtol: float, dtype: torch.dtype) -> None:
        self.refs, self.atol, self.rtol, self.dtype = refs, atol, rtol, dtype
        self.result: Dict[str, Any] = {"errors": {}, "ok": True, "problems": []}

    def fail(self, text: str) -> None:
        self.result["ok"] = False
        self.result["problems"].append(text)

    def check(self, name: str, got) -> None:
        res = compare(got, self.refs[name], self.atol, self.rtol)
        err = res["max_abs"]
        self.result["errors"][name] = err if err is not None and math.isfinite(err) else None  # JSON has no inf
        if not res["ok"]:
            self.fail(f"{name}: {res['problem']}")

    def outputs(self, out, lse, check_lse: bool) -> None:
        self.check("out", out)
        if out is not None and out.dtype != self.dtype:
            self.fail(f"out dtype {dtype_name(out.dtype)}, contract says {dtype_name(self.dtype)}")
        if check_lse:
            self.check("lse", lse)
            want = _expected_lse_dtype(self.dtype)
            if lse is not None and lse.dtype != want:
                self.fail(f"lse dtype {lse.dtype}, contract says {want}")

    def grads(self, grads) -> None:
        for name, got in zip(("dq", "dk", "dv"), grads):
            self.check(name, got)

    def run(self, fn) -> dict:
        try:
            with torch.no_grad():
                fn()
        except Exception as exc:  # a failing kernel is a verification result, not a crash
            self.fail(f"{type(exc).__name__}: {exc}")
        return self.result


def verify_backend(backend, device_type: str, *, dtypes: Optional[Iterable] = None,
                   features: Optional[dict] = None, seed: int = 0) -> list:
    """Verify ``backend`` on ``device_type`` for each declared dtype (or ``dtypes``).

    ``features`` ({feature: bool}) narrows what is exercised; by default every feature the
    declarations accept for the dtype (the same cases a CI matrix entry runs).
    A dtype or case the declarations refuse on this device is reported as ``skip`` with the
    reasons.  Returns one result dict per (dtype, case).
    """
    cc = _platform.compute_capability(device_type)
    declared = [parse_dtype(d) for d in capability_row(backend)["dtypes"]]
    wanted = declared if dtypes is None else [parse_dtype(d) for d in dtypes]
    rows = []
    for dtype in wanted:
        base = base_request(backend, device_type, dtype, cc)
        row0 = {"backend": backend.NAME, "device": device_type, "dtype": dtype_name(dtype),
                "head_dim": base.head_dim, "tolerance": list(tolerances_for(backend, dtype))}
        refused = backend.not_supported_reasons(base)
        if refused:
            rows.append({**row0, "case": "-", "status": "skip", "errors": {}, "reason": "; ".join(refused)})
            continue
        have = supported_features(backend, base)
        if features is None:     # every feature the declarations accept (what the CI matrix entry runs too)
            use = {f: have[f] for f in FEATURES if f != "fwd"}
        else:
            use = {f: bool(features.get(f)) for f in FEATURES if f != "fwd"}
        # with the lengths the cases use, so that rules on Sq/Sk (e.g. a kernel's key blocks) refuse up front
        checked = base.with_(needs_grad=use.get("bwd", False), needs_lse=use.get("ring", False),
                             seqlen_q=VERIFY_SEQLEN, seqlen_k=VERIFY_SEQLEN)
        for case, change in _cases(backend, checked, use):
            req = checked.with_(**change)
            why = backend.not_supported_reasons(req)
            if why:
                rows.append({**row0, "case": case, "status": "skip", "errors": {}, "reason": "; ".join(why)})
                continue
            call = KernelCall(causal=req.causal, window=req.window, softcap=req.softcap, needs_grad=req.needs_grad,
                              needs_lse=req.needs_lse)
            res = verify_case(backend, device_type, dtype, base.head_dim, call, num_kv_heads=req.num_kv_heads,
                              seed=seed)
            rows.append({**row0, "case": case, "status": "pass" if res["ok"] else "fail",
                         "errors": res["errors"], "reason": "; ".join(res["problems"])})
        if getattr(backend, "VARLEN_KERNEL", False):
            gqa = feature_change(backend, checked, "gqa") if use.get("gqa") else None
            kv = (gqa or {}).get("num_kv_heads")
            packed = [("packed", False)] + ([("packed-causal", True)] if use.get("causal") else [])
            for case, causal in packed:
                res = verify_packed_case(backend, device_type, dtype, base.head_dim, causal=causal, num_kv_heads=kv,
                                         check_lse=checked.needs_lse, check_grad=checked.needs_grad, seed=seed)
                rows.append({**row0, "case": case, "status": "pass" if res["ok"] else "fail",
                             "errors": res["errors"], "reason": "; ".join(res["problems"])})
    return rows


#: the packed case: per sequence (queries, keys); causal packs use the query lengths for both
VERIFY_PACKED = ((5, 9), (1, 2), (12, 12), (3, 1), (17, 6))


def verify_packed_case(backend, device_type: str, dtype: torch.dtype, head_dim: int, *, causal=False,
                       num_kv_heads: Optional[int] = None, check_lse: bool = True, check_grad: bool = True,
                       seed: int = 0) -> dict:
    """The packed-sequence (varlen) entry point of a backend that declares one
    (``forward_packed``/``backward_packed``): sequences of different lengths back to back,
    each compared with float64 attention of that sequence alone.  Same result shape as
    :func:`verify_case`."""
    from ..parallel.ring import Packing
    atol, rtol = tolerances_for(backend, dtype)
    h = VERIFY_HEADS
    hkv = h if num_kv_heads is None else num_kv_heads
    lens = [(nq, nq if causal else nk) for nq, nk in VERIFY_PACKED]
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, h, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(tk, hkv, head_dim, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(tq, h, head_dim, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    qr, kr, vr = (x.to(torch.float64).requires_grad_(check_grad) for x in (q, k, v))
    outs, lses = [], []
    a = c = 0
    for nq, nk in lens:
        o, lse = reference_attention(qr[None, a:a + nq], kr[None, c:c + nk], vr[None, c:c + nk],
                                     softmax_scale=scale, causal=causal)
        outs.append(o[0])
        lses.append(lse[0])
        a, c = a + nq, c + nk
    checks = _Checks(_references(torch.cat(outs), torch.cat(lses, dim=1), dout, (qr, kr, vr), check_grad), atol,
                     rtol, dtype)
    dev = _tensor_device(device_type)

    def run():
        kernel = backend()
        packing = Packing([nq for nq, _ in lens], [nk for _, nk in lens], dev)
        qd, kd, vd, dod = (x.to(dev) for x in (q, k, v, dout))
        call = KernelCall(scale=scale, causal=causal, packing=packing)
        out, lse = kernel.forward_packed(qd, kd, vd, call)
        checks.outputs(out, lse, check_lse)
        if check_grad:
            checks.grads(kernel.backward_packed(dod, qd, kd, vd, out, lse, call))
    return checks.run(run)


# ----------------------------------------------------------------------------- collect
def backend_rows(registry=None) -> list:
    """One row per registered backend; never raises (an import failure is the reason)."""
    reg = registry if registry is not None else REGISTRY
    rows = []
    for name in reg.names():
        row = {"name": name, "available": False, "reason": "", "version": None, "device": None,
               "capabilities": {}}
        try:
            cls = reg.get(name)
        except Exception as exc:
            row["reason"] = f"adapter failed to import: {type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        row["capabilities"] = capability_row(cls)
        try:
            avail = cls.availability()
        except Exception as exc:
            row["reason"] = f"availability check raised {type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        row.update(available=bool(avail.ok), reason=avail.reason, version=avail.version,
                   device=(avail.details or {}).get("device"))
        if avail.ok and row["device"]:
            row["here"] = _here(cls, row["device"])
        rows.append(row)
    return rows


def _here(cls, device: str) -> dict:
    """What the declared per-device limits leave of the class's capabilities on this machine's
    device: ``{"backward": bool, "backward_reason": str}`` (a backward the class has but a
    limit refuses here, e.g. flex on the CPU)."""
    from ..dispatch.capabilities import AttnRequest, sorted_dtypes
    dtypes = sorted_dtypes(cls.SUPPORTED_DTYPES)
    dtype = torch.float32 if torch.float32 in dtypes else (dtypes[0] if dtypes else torch.float32)
    base = AttnRequest(dtype=dtype, device_type=device, head_dim=64, num_heads=1)
    plain = set(cls.not_supported_reasons(base))
    extra = [r for r in cls.not_supported_reasons(base.with_(needs_grad=True)) if r not in plain]
    ok = bool(cls.HAS_BACKWARD) and not extra
    return {"backward": ok, "backward_reason": "; ".join(extra)}


def _probe_child(cmd: list, row0: dict, limit: float, late: str, failed: str, env=None) -> list:
    """Run ``usp-hal probe --verify --json ...`` in a child process under ``limit`` seconds and
    return its result rows, or one ``timeout``/``fail`` row (``late``/``failed``: their reasons)."""
    import subprocess
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return [{**row0, "status": "timeout", "reason": late}]
    try:
        return json.loads(res.stdout)["verify"]["results"]
    except Exception:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return [{**row0, "status": "fail", "reason": f"{failed} (exit {res.returncode}): " + " | ".join(tail)}]


def _verify_in_child(name: str, dtypes: Optional[list], timeout: float) -> list:
    """Verify one backend in a separate interpreter under a time limit (first-use JIT
    compilation can be slow); a backend that does not finish gets one ``timeout`` row."""
    cmd = [sys.executable, "-m", "usp_hal", "probe", "--verify", "--json", "--backend", name]
    for d in dtypes or []:
        cmd += ["--dtype", dtype_name(d)]
    row0: Any = {"backend": name, "device": None, "dtype": "-", "case": "-", "head_dim": None, "tolerance": None,
            "errors": {}}
    return _probe_child(cmd, row0, timeout,
                        f"verification did not finish within {timeout:g} s (first-use kernel compilation?)",
                        "verification process failed")


def _verify_interpreted(name: str, dtypes: Optional[list], timeout: Optional[float]) -> list:
    """``name``'s real Triton kernel under the Triton interpreter, in a child process started
    with the interpreter's variables (:mod:`usp_hal.backends.interpret`); in that child (marked
    by ``USP_HAL_INTERPRET_CHILD``) the rows are computed on the emulated device."""
    import os

    from ..backends import interpret
    row0: Any = {"backend": name, "device": None, "dtype": "-", "case": "-", "head_dim": None, "tolerance": None,
                 "errors": {}, "interpreted": True}
    if os.environ.get(INTERPRET_CHILD) == "1":
        interpret.prepare(name)
        emulation = interpret.EMULATION[name]
        with _platform.emulate(**emulation):
            rows = verify_backend(REGISTRY.get(name), emulation["device_type"],
                                  dtypes=dtypes or list(interpret.DTYPES[name]))
        return [{**r, "interpreted": True} for r in rows]
    why = interpret.missing(name)
    if why:
        return [{**row0, "status": "fail", "reason": f"cannot run under the Triton interpreter here: {why}"}]
    cmd = [sys.executable, "-m", "usp_hal", "probe", "--verify", "--interpret", "--json", "--backend", name]
    for d in dtypes or []:
        cmd += ["--dtype", dtype_name(d)]
    env = {**os.environ, **interpret.ENV, INTERPRET_CHILD: "1"}
    limit = timeout or 900.0
    return _probe_child(cmd, row0, limit, f"the interpreted verification did not finish within {limit:g} s",
                        "interpreted verification failed", env=env)


#: marks the child process of ``probe --verify --interpret`` (set by the parent, never by hand)
INTERPRET_CHILD = "USP_HAL_INTERPRET_CHILD"


def summarize(report: dict) -> list:
    """One line per backend: verified, refused (why), unavailable (why), failed or timeout."""
    results = (report.get("verify") or {}).get("results", [])
    seconds = (report.get("verify") or {}).get("seconds", {})
    out = []
    interpreted = {r["backend"] for r in results if r.get("interpreted")}
    for row in report["backends"]:
        name = row["name"]
        if not row["available"] and name not in interpreted:
            out.append({"backend": name, "status": "unavailable", "detail": row["reason"]})
            continue
        mine = [r for r in results if r["backend"] == name]
        if not mine:
            out.append({"backend": name, "status": "available", "detail": "not verified in this run"})
            continue
        bad = [r for r in mine if r["status"] in ("fail", "timeout")]
        passed = [r for r in mine if r["status"] == "pass"]
        skipped = [r for r in mine if r["status"] == "skip"]
        if bad:
            status = "timeout" if all(r["status"] == "timeout" for r in bad) else "failed"
            out.append({"backend": name, "status": status,
                        "detail": "; ".join(f"{r['dtype']} {r['case']}: {r['reason']}" for r in bad)})
        elif passed:
            note = f"{len(passed)} case(s) pass" + (f" in {seconds[name]:g} s" if name in seconds else "")
            if skipped:
                note += "; refused here: " + "; ".join(f"{r['dtype']} {r['case']}: {r['reason']}" for r in skipped)
            if name in interpreted:
                note = "its real Triton kernel under the Triton interpreter on the CPU (emulated device; API and " \
                       "arithmetic only, not the hardware): " + note
            out.append({"backend": name, "status": "verified", "detail": note})
        else:
            out.append({"backend": name, "status": "refused",
                        "detail": "; ".join(sorted({r["reason"] for r in skipped}))})
    return out


def collect(*, registry=None, verify: bool = False, only: Optional[list] = None,
            dtypes: Optional[list] = None, timeout: Optional[float] = None, interpret: bool = False) -> dict:
    """Everything the probe reports, as plain data (what ``--json`` prints).  With
    ``timeout``, each backend is verified in its own process under that limit (seconds).
    ``interpret`` (asked for explicitly, never implied): verify the backends whose kernels are
    Triton code (``usp_hal.backends.interpret.EMULATION``) under the Triton interpreter, each in
    a process of its own, instead of the available backends."""
    reg = registry if registry is not None else REGISTRY
    info = _platform.info()
    report: Dict[str, Any] = {
        "usp_hal": __version__,
        "torch": {"version": info.torch_version, "cuda": info.cuda_version, "hip": info.hip_version,
                  "xpu": info.xpu_version},
        "platform": {
            "device_type": info.device_type,
            "device_types": list(info.device_types),
            "device_count": info.device_count,
            "device_name": info.device_name,
            "compute_capability": list(info.compute_capability) if info.compute_capability else None,
        },
        "dist_backends": dict(info.dist_backends),
        "backends": backend_rows(reg),
    }
    if verify and interpret:
        from ..backends.interpret import EMULATION
        names = [reg.canonical_name(n) for n in only] if only else list(EMULATION)
        unknown = [n for n in names if n not in EMULATION]
        if unknown:
            raise ValueError(f"--interpret runs Triton kernels only ({', '.join(EMULATION)}), not {', '.join(unknown)}")
        rows: list = []
        took: dict = {}
        for name in names:
            start = time.monotonic()
            rows.extend(_verify_interpreted(name, dtypes, timeout))
            took[name] = round(time.monotonic() - start, 1)
        report["verify"] = {"ok": all(r["status"] not in ("fail", "timeout") for r in rows), "results": rows,
                            "seconds": took, "interpreted": True}
        report["summary"] = summarize(report)
        return report
    if verify:
        wanted = [reg.canonical_name(n) for n in only] if only else None
        if wanted and "auto" in wanted:
            raise ValueError("'auto' is not a backend; name backends to verify, or omit --backend for all")
        results: Any = []
        seconds: dict = {}
        for row in report["backends"]:
            if wanted is not None and row["name"] not in wanted:
                continue
            if not row["available"]:
                if wanted is not None:  # asked for by name: being unavailable is a failure
                    results.append({"backend": row["name"], "device": None, "dtype": "-", "case": "-",
                                    "head_dim": None, "tolerance": None, "status": "fail", "errors": {},
                                    "reason": f"unavailable: {row['reason']}"})
                continue
            start = time.monotonic()
            if timeout:
                results.extend(_verify_in_child(row["name"], dtypes, timeout))
            else:
                results.extend(verify_backend(reg.get(row["name"]), row["device"], dtypes=dtypes))
            seconds[row["name"]] = round(time.monotonic() - start, 1)
        report["verify"] = {"ok": all(r["status"] not in ("fail", "timeout") for r in results), "results": results}
        report["verify"]["seconds"] = seconds
        report["summary"] = summarize(report)
    return report
