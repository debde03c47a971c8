"""``usp-hal probe``: what this machine can run, and why not.

Prints the torch build, the devices, the distributed backends torch can create here, then
one row per registered attention backend: available or not (with the exact reason), and
its declared capabilities as read from the backend class.  A backend whose adapter fails
to import is still listed, with the import error as its reason.

``--verify`` runs every available backend once on this device for each dtype it declares
(small shapes; causal and not; GQA when declared) and compares ``out``, ``lse`` and, for
backends with a backward, ``dq``/``dk``/``dv`` with the float64 reference, using the
per-dtype tolerances of :mod:`usp_hal.dispatch.reference`.  The exit status is 1 when any check
fails.  ``--json`` prints the same data as JSON.

``--verify --interpret`` verifies, instead, the backends whose kernels are Triton code
(SageAttention 1.0.6, flash-attn's Triton AMD build) under the Triton interpreter on the CPU,
each in a process started with ``TRITON_INTERPRET=1`` and its device emulated
(:mod:`usp_hal.backends.interpret`): the kernel's maths through the adapter before renting the
hardware.  It is only ever used when asked for.

The report and the verification come from :mod:`usp_hal.harness.verify` (also what the CI
matrix and its tests use); this module parses the arguments and prints.
"""
from __future__ import annotations

import json
import sys

from ..dispatch.capabilities import parse_dtype
from ..harness.verify import OPTION_FEATURES, collect


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

    # the options as declared (capability_row: one flag under each feature's name)
    headers = ["backend", "available", "version", "fwd", "bwd", "lse(ring)", *OPTION_FEATURES, "dtypes", "devices",
               "min cc"]
    rows = []
    for r in report["backends"]:
        c = r["capabilities"]
        if not c:
            rows.append([r["name"], "no", "-"] + ["?"] * (len(headers) - 3))
            continue
        here = r.get("here") or {}
        bwd = _yes(c["backward"])
        if c["backward"] and here.get("backward") is False:
            bwd = f"no on {r['device']}"          # the class has one, a declared limit refuses it here
        rows.append([r["name"], _yes(r["available"]), r["version"] or "-", _yes(c["forward"]), bwd, _yes(c["lse"]),
                     *(_yes(c[f]) for f in OPTION_FEATURES), ",".join(c["dtypes"]), ",".join(c["devices"]),
                     _min_cc(c)])
    out += ["", "Backends (capabilities as declared; '?' = adapter could not be imported)",
            format_table(headers, rows)]
    limited = [r for r in report["backends"] if (r.get("here") or {}).get("backward_reason")]
    if limited:
        out += ["", "Limits on this machine's device:"]
        out += [f"  {r['name']}: {r['here']['backward_reason']}" for r in limited]
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
    p.add_argument("--interpret", action="store_true",
                   help="with --verify: run the backends whose kernels are Triton code (sage_fp8, fa2's Triton AMD "
                        "build) under the Triton interpreter on the CPU, with their device emulated; checks the "
                        "kernel's API and arithmetic through the adapter, not the hardware (needs triton and the "
                        "package; never chosen without this flag)")
    p.set_defaults(func=run)


def run(args) -> int:
    if (args.backend or args.dtype or args.timeout or args.interpret) and not args.verify:
        print("usp-hal probe: --backend/--dtype/--timeout/--interpret only apply with --verify", file=sys.stderr)
        return 2
    try:
        dtypes = [parse_dtype(d) for d in args.dtype] if args.dtype else None
        report = collect(verify=args.verify, only=args.backend, dtypes=dtypes, timeout=args.timeout,
                         interpret=args.interpret)
    except ValueError as exc:  # unknown backend or dtype name
        print(f"usp-hal probe: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    if args.verify and not report["verify"]["ok"]:
        return 1
    return 0
