"""``usp-hal probe``: what this machine can run, and why not.

Prints the torch build, the devices, the distributed backends torch can create here, then
one row per registered attention backend: available or not (with the exact reason), and
its declared capabilities as read from the backend class.  A backend whose adapter fails
to import is still listed, with the import error as its reason.

``--verify`` runs every available backend once on this device for each dtype it declares
(small shapes; causal and not; GQA when declared) and compares ``out``, ``lse`` and, for
backends with a backward, ``dq``/``dk``/``dv`` with the float64 reference, using the
per-dtype tolerances of :mod:`usp_hal.reference`.  The exit status is 1 when any check
fails.  ``--json`` prints the same data as JSON.

The helpers here (:func:`supported_features`, :func:`verify_backend`) are also what the CI
matrix and its tests use, so "what a backend is tested for" has one definition.
"""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Iterable, Optional

import torch

from .. import __version__
from .. import platform as _platform
from ..capabilities import AttnRequest, capability_row, dtype_name, parse_dtype
from ..reference import TOLERANCES, reference_attention
from ..registry import REGISTRY

# ----------------------------------------------------------------------------- features
#: Feature flags a backend is tested for, in display order.
FEATURES = ("fwd", "bwd", "ring", "causal", "window", "softcap", "gqa")

VERIFY_BATCH = 2
VERIFY_SEQLEN = 32
VERIFY_HEADS = 4
VERIFY_KV_HEADS = 2          # the GQA case: two query heads per key/value head
VERIFY_WINDOW = (6, 2)       # (left, right); narrower than the sequence on both sides
VERIFY_LEFT_WINDOW = (6, 0)  # causal sliding window, for kernels with a left bound only
VERIFY_SOFTCAP = 1.0         # small enough that the cap changes the scores noticeably
# first head dim (in this order) that a backend's declarations accept is used for checks
HEAD_DIM_CANDIDATES = (64, 128, 32, 96, 80, 16, 256, 8)

#: feature -> request changes that exercise it, in order of preference.  A feature is
#: supported when the backend's ``not_supported_reasons`` accepts one of them; the first
#: accepted one is what gets verified.
FEATURE_VARIANTS = {
    "fwd": ({},),
    "bwd": ({"needs_grad": True},),
    "ring": ({"needs_lse": True},),
    "causal": ({"causal": True},),
    "window": ({"window": VERIFY_WINDOW}, {"window": VERIFY_LEFT_WINDOW, "causal": True}),
    "softcap": ({"softcap": VERIFY_SOFTCAP},),
    "gqa": ({"num_kv_heads": VERIFY_KV_HEADS},),
}


def feature_change(backend, base: AttnRequest, feature: str) -> Optional[dict]:
    """The first variant of ``feature`` that ``backend`` accepts on top of ``base``, or None."""
    try:
        variants = FEATURE_VARIANTS[feature]
    except KeyError:
        raise ValueError(f"unknown feature {feature!r}; valid: {', '.join(FEATURES)}") from None
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
    cases = [("plain", {})]
    causal = feature_change(backend, base, "causal") if use.get("causal") else None
    if causal is not None:
        cases.append(("causal", causal))
    if use.get("gqa"):
        gqa = feature_change(backend, base, "gqa")
        if gqa is not None:
            change = {**gqa, **(causal or {})}
            cases.append(("gqa-causal" if change.get("causal") else "gqa", change))
    for feature in ("window", "softcap"):
        change = feature_change(backend, base, feature) if use.get(feature) else None
        if change is not None:
            cases.append((feature + ("-causal" if change.get("causal") else ""), change))
    return cases


def _max_error(got, ref: torch.Tensor, atol: float, rtol: float) -> tuple:
    """(max abs error, within tolerance?, problem text) comparing ``got`` with ``ref`` (float64, cpu)."""
    if got is None:
        return math.inf, False, "missing"
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf, False, f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    g = got.detach().to("cpu", torch.float64)
    same_inf = torch.isinf(g) & torch.isinf(ref) & (torch.sign(g) == torch.sign(ref))
    diff = (g - ref).abs().masked_fill(same_inf, 0.0)
    diff = torch.nan_to_num(diff, nan=math.inf)
    bound = atol + rtol * ref.abs().masked_fill(torch.isinf(ref), 0.0)
    ok = bool((diff <= bound).all())
    err = float(diff.max()) if diff.numel() else 0.0
    return err, ok, "" if ok else "exceeds tolerance"


def _expected_lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def verify_case(backend, device_type: str, dtype: torch.dtype, head_dim: int, *, causal=False,
                num_kv_heads: Optional[int] = None, window=(-1, -1), softcap=0.0,
                check_lse: bool = True, check_grad: bool = True, seed: int = 0,
                tolerance: Optional[tuple] = None) -> dict:
    """Run ``backend`` once on ``device_type`` and compare with the float64 reference.

    Returns ``{"errors": {name: max abs error}, "ok": bool, "problems": [text]}``; a kernel
    that raises gives ``ok=False`` with the exception as the problem.  ``tolerance``
    defaults to :func:`tolerances_for` the backend.
    """
    atol, rtol = tolerance if tolerance is not None else tolerances_for(backend, dtype)
    b, s, h = VERIFY_BATCH, VERIFY_SEQLEN, VERIFY_HEADS
    hkv = h if num_kv_heads is None else num_kv_heads
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, heads, head_dim, generator=gen).to(dtype) for heads in (h, hkv, hkv))
    dout = torch.randn(b, s, h, head_dim, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    opts = dict(softmax_scale=scale, causal=causal, window=tuple(window), softcap=softcap)

    qr, kr, vr = (x.to(torch.float64).requires_grad_(check_grad) for x in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, **opts)
    if check_grad:
        ref_out.backward(dout.to(torch.float64))
    refs = {"out": ref_out.detach(), "lse": ref_lse.detach()}
    if check_grad:
        refs.update(dq=qr.grad, dk=kr.grad, dv=vr.grad)

    result = {"errors": {}, "ok": True, "problems": []}

    def check(name, got):
        err, ok, problem = _max_error(got, refs[name], atol, rtol)
        result["errors"][name] = err if math.isfinite(err) else None  # JSON has no inf
        if not ok:
            result["ok"] = False
            result["problems"].append(f"{name}: {problem}")

    dev = torch.device(_platform.torch_device_name(device_type))
    try:
        kernel = backend()
        qd, kd, vd, dod = (x.to(dev) for x in (q, k, v, dout))
        with torch.no_grad():
            out, lse = kernel.forward(qd, kd, vd, **opts)
            check("out", out)
            if out is not None and out.dtype != dtype:
                result["ok"] = False
                result["problems"].append(f"out dtype {dtype_name(out.dtype)}, contract says {dtype_name(dtype)}")
            if check_lse:
                check("lse", lse)
                want = _expected_lse_dtype(dtype)
                if lse is not None and lse.dtype != want:
                    result["ok"] = False
                    result["problems"].append(f"lse dtype {lse.dtype}, contract says {want}")
            if check_grad:
                grads = kernel.backward(dod, qd, kd, vd, out, lse, **opts)
                for name, got in zip(("dq", "dk", "dv"), grads):
                    check(name, got)
    except Exception as exc:  # a failing kernel is a verification result, not a crash
        result["ok"] = False
        result["problems"].append(f"{type(exc).__name__}: {exc}")
    return result


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
        checked = base.with_(needs_grad=use.get("bwd", False), needs_lse=use.get("ring", False))
        for case, change in _cases(backend, checked, use):
            req = checked.with_(**change)
            why = backend.not_supported_reasons(req)
            if why:
                rows.append({**row0, "case": case, "status": "skip", "errors": {}, "reason": "; ".join(why)})
                continue
            res = verify_case(backend, device_type, dtype, base.head_dim,
                              causal=req.causal, num_kv_heads=req.num_kv_heads, window=req.window,
                              softcap=req.softcap, check_lse=req.needs_lse, check_grad=req.needs_grad,
                              seed=seed)
            rows.append({**row0, "case": case, "status": "pass" if res["ok"] else "fail",
                         "errors": res["errors"], "reason": "; ".join(res["problems"])})
    return rows


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
        rows.append(row)
    return rows


def _verify_in_child(name: str, dtypes: Optional[list], timeout: float) -> list:
    """Verify one backend in a separate interpreter under a time limit (first-use JIT
    compilation can be slow); a backend that does not finish gets one ``timeout`` row."""
    import subprocess
    cmd = [sys.executable, "-m", "usp_hal", "probe", "--verify", "--json", "--backend", name]
    for d in dtypes or []:
        cmd += ["--dtype", dtype_name(d)]
    row0 = {"backend": name, "device": None, "dtype": "-", "case": "-", "head_dim": None, "tolerance": None,
            "errors": {}}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{**row0, "status": "timeout",
                 "reason": f"verification did not finish within {timeout:g} s (first-use kernel compilation?)"}]
    try:
        return json.loads(res.stdout)["verify"]["results"]
    except Exception:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return [{**row0, "status": "fail", "reason": f"verification process failed (exit {res.returncode}): "
                                                     + " | ".join(tail)}]


def summarize(report: dict) -> list:
    """One line per backend: verified, refused (why), unavailable (why), failed or timeout."""
    results = (report.get("verify") or {}).get("results", [])
    seconds = (report.get("verify") or {}).get("seconds", {})
    out = []
    for row in report["backends"]:
        name = row["name"]
        if not row["available"]:
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
            out.append({"backend": name, "status": "verified", "detail": note})
        else:
            out.append({"backend": name, "status": "refused",
                        "detail": "; ".join(sorted({r["reason"] for r in skipped}))})
    return out


def collect(*, registry=None, verify: bool = False, only: Optional[list] = None,
            dtypes: Optional[list] = None, timeout: Optional[float] = None) -> dict:
    """Everything the probe reports, as plain data (what ``--json`` prints).  With
    ``timeout``, each backend is verified in its own process under that limit (seconds)."""
    reg = registry if registry is not None else REGISTRY
    info = _platform.info()
    report = {
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
    if verify:
        wanted = [reg.canonical_name(n) for n in only] if only else None
        if wanted and "auto" in wanted:
            raise ValueError("'auto' is not a backend; name backends to verify, or omit --backend for all")
        results = []
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


# ----------------------------------------------------------------------------- text output
def _yes(flag) -> str:
    return "yes" if flag else "no"


def format_table(headers: list, rows: list) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _min_cc(caps: dict) -> str:
    mincc = caps.get("min_compute_capability") or {}
    return ", ".join(f"{dev} {v[0]}.{v[1]}" for dev, v in sorted(mincc.items())) or "-"


def _fmt_err(errors: dict, name: str) -> str:
    if name not in errors:
        return "-"                      # not checked
    x = errors[name]
    return "inf" if x is None else f"{x:.1e}"


def format_text(report: dict) -> str:
    t, p = report["torch"], report["platform"]
    builds = ", ".join(f"{k} {v}" for k, v in (("cuda", t["cuda"]), ("hip", t["hip"]), ("xpu", t["xpu"])) if v)
    cc = p["compute_capability"]
    absent = ", ".join(n for n, ok in report["dist_backends"].items() if not ok)
    facts = [
        ("usp-hal", report["usp_hal"]),
        ("torch", t["version"] + (f" ({builds})" if builds else " (no accelerator build)")),
        ("device", f"{p['device_type']} x{p['device_count']} ({p['device_name']})"
                   + (f", compute capability {cc[0]}.{cc[1]}" if cc else "")),
        ("device types", ", ".join(p["device_types"])),
        ("dist backends", (", ".join(n for n, ok in report["dist_backends"].items() if ok) or "none")
         + (f"  (unavailable: {absent})" if absent else "")),
    ]
    width = max(len(k) for k, _ in facts)
    out = [f"{k.ljust(width)}  {v}" for k, v in facts]

    headers = ["backend", "available", "version", "fwd", "bwd", "lse(ring)", "causal", "window",
               "softcap", "gqa", "dtypes", "devices", "min cc"]
    rows = []
    for r in report["backends"]:
        c = r["capabilities"]
        if not c:
            rows.append([r["name"], "no", "-"] + ["?"] * (len(headers) - 3))
            continue
        rows.append([r["name"], _yes(r["available"]), r["version"] or "-", _yes(c["forward"]),
                     _yes(c["backward"]), _yes(c["lse"]), _yes(c["causal"]), _yes(c["window"]),
                     _yes(c["softcap"]), _yes(c["gqa"]), ",".join(c["dtypes"]), ",".join(c["devices"]),
                     _min_cc(c)])
    out += ["", "Backends (capabilities as declared; '?' = adapter could not be imported)",
            format_table(headers, rows)]
    missing = [r for r in report["backends"] if not r["available"]]
    if missing:
        out += ["", "Unavailable here:"]
        width = max(len(r["name"]) for r in missing)
        out += [f"  {r['name'].ljust(width)}  {r['reason']}" for r in missing]

    if "verify" in report:
        v = report["verify"]
        vh = ["backend", "device", "dtype", "case", "out", "lse", "dq", "dk", "dv", "result"]
        vrows = [[r["backend"], r["device"] or "-", r["dtype"], r["case"]]
                 + [_fmt_err(r["errors"], n) for n in ("out", "lse", "dq", "dk", "dv")]
                 + [r["status"]] for r in v["results"]]
        out += ["", "Verification against the float64 reference (max abs error; tolerances per dtype)"]
        out.append(format_table(vh, vrows) if vrows else "  nothing to verify")
        notes = [r for r in v["results"] if r["reason"]]
        if notes:
            out += [""] + [f"  {r['backend']} {r['dtype']} {r['case']}: {r['status']}: {r['reason']}" for r in notes]
        summary = report.get("summary") or []
        if summary:
            width = max(len(r["backend"]) for r in summary)
            out += ["", "Per backend (verified, refused, unavailable, failed, timeout):"]
            out += [f"  {r['backend'].ljust(width)}  {r['status']}" + (f": {r['detail']}" if r["detail"] else "")
                    for r in summary]
        out += ["", "verification: " + ("PASSED" if v["ok"] else "FAILED")]
    return "\n".join(out)


# ----------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "probe", help="show what this machine supports, and why not",
        description="List the torch build, devices, distributed backends and every registered "
                    "attention backend with its availability and declared capabilities.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--verify", action="store_true",
                   help="run each available backend against the float64 reference (exit 1 on failure)")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="with --verify: only these backends (repeatable); an unavailable one fails")
    p.add_argument("--dtype", action="append", metavar="DTYPE",
                   help="with --verify: only these dtypes (repeatable: fp64, fp32, bf16, fp16)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="with --verify: verify each backend in its own process, at most this long")
    p.set_defaults(func=run)


def run(args) -> int:
    if (args.backend or args.dtype or args.timeout) and not args.verify:
        print("usp-hal probe: --backend/--dtype/--timeout only apply with --verify", file=sys.stderr)
        return 2
    try:
        dtypes = [parse_dtype(d) for d in args.dtype] if args.dtype else None
        report = collect(verify=args.verify, only=args.backend, dtypes=dtypes, timeout=args.timeout)
    except ValueError as exc:  # unknown backend or dtype name
        print(f"usp-hal probe: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    if args.verify and not report["verify"]["ok"]:
        return 1
    return 0
