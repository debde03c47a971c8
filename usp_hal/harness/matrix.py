"""Per-device CI matrices and the backend docs table, from the declarations (what
``usp-hal matrix`` prints and writes).

Nothing here is written by hand per backend.  A *profile* is a CI device (a device type and,
for CUDA, a compute capability).  For each profile and each backend shipped with usp-hal,
every declared dtype is put to the backend's own ``not_supported_reasons``; the dtypes it
accepts become matrix entries, each with the feature flags
(:data:`usp_hal.harness.verify.FEATURES`) that the same function accepts for that dtype on
that device.  Per-version and per-device rules (``LIMITS``) are therefore honoured too.
:func:`generate_docs` renders ``docs/backends.md`` from the same declarations, one row per
feature of :data:`usp_hal.harness.verify.DECLARED`.
"""
from __future__ import annotations

import importlib.metadata

from ..dispatch import platform as _platform
from ..dispatch.backend import installed_version
from ..dispatch.capabilities import capability_row, parse_dtype
from ..dispatch.registry import ENTRY_POINT_GROUP, REGISTRY
from .verify import DECLARED, FEATURES, Feature, base_request, feature_change, supported_features

DOCS_PATH = "docs/backends.md"
DOCS_COMMAND = "usp-hal matrix --docs"
_PROJECT_PACKAGE = "usp_hal.backends."


# A CI device (what a self-hosted runner labelled ``name`` provides) is declared by its
# platform entry; the profiles are read from there.
Profile = _platform.CIProfile
PROFILES = {prof.name: prof for p in _platform.PLATFORMS.values() for prof in p.ci_profiles}


def machine_profile() -> Profile:
    """The profile this machine matches (its default device; for CUDA the highest
    profile compute capability not above the device's)."""
    dev = _platform.default_device_type()
    cc = _platform.compute_capability(dev)
    fits = [p for p in PROFILES.values() if p.device_type == dev
            and (p.compute_capability is None or (cc is not None and tuple(cc) >= p.compute_capability))]
    if not fits:
        found = f"{dev}" + (f" sm{cc[0]}{cc[1]}" if cc else "")
        raise ValueError(f"no CI profile matches this machine ({found}); profiles: {', '.join(PROFILES)}")
    return max(fits, key=lambda p: p.compute_capability or (0, 0))


def get_profile(name: str) -> Profile:
    if name == "auto":
        return machine_profile()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; valid: {', '.join(PROFILES)}, auto") from None


# ----------------------------------------------------------------------------- backends
def _plugin_names() -> set:
    try:
        return {ep.name.lower() for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    except Exception:  # pragma: no cover - broken metadata is reported by the registry itself
        return set()


def project_backends(registry=None) -> list:
    """Backend classes shipped with usp-hal (``usp_hal.backends.*``), in registry order.

    Out-of-tree plugins are left out: they are not ours to document or test.  A shipped
    adapter that fails to import is an error here; a matrix or doc that silently lacked a
    backend would be wrong.
    """
    reg = registry if registry is not None else REGISTRY
    plugins = _plugin_names()
    out = []
    for name in reg.names():
        try:
            cls = reg.get(name)
        except Exception as exc:
            if name in plugins:
                continue
            raise RuntimeError(f"backend {name!r} could not be imported ({type(exc).__name__}: {exc}); "
                               "the matrix and docs are generated from its declarations") from exc
        if cls.__module__.startswith(_PROJECT_PACKAGE):
            out.append(cls)
    return out


def installed_kernel_packages(registry=None) -> list:
    """Distributions of shipped backends that are installed here.  Rules that depend on an
    installed version (``LIMITS``) can then change the generated docs."""
    found = []
    for cls in project_backends(registry):
        found += [f"{p.dist} {installed_version(p)}" for p in cls.REQUIRED_PACKAGES if installed_version(p)]
    return sorted(set(found))


def _extras(cls, wheels_only: bool = False) -> list:
    return sorted({p.extra for p in cls.REQUIRED_PACKAGES if p.extra and (p.wheel or not wheels_only)})


# ----------------------------------------------------------------------------- matrix
def matrix_entries(profile: Profile, registry=None) -> list:
    """One entry per (backend, dtype) that ``profile`` can run, with its feature flags."""
    entries = []
    cc = profile.compute_capability
    for cls in project_backends(registry):
        for dname in capability_row(cls)["dtypes"]:
            base = base_request(cls, profile.device_type, parse_dtype(dname), cc)
            if cls.not_supported_reasons(base):
                continue
            entries.append({
                "profile": profile.name,
                "device": profile.device_type,
                "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
                "backend": cls.NAME,
                "dtype": dname,
                "head_dim": base.head_dim,
                **supported_features(cls, base),
                "extra": ",".join(_extras(cls)),
                "wheel_extra": ",".join(_extras(cls, wheels_only=True)),
            })
    return entries


def profile_extras(entries: list, wheels_only: bool = False) -> list:
    key = "wheel_extra" if wheels_only else "extra"
    return sorted({x for e in entries for x in e.get(key, e["extra"]).split(",") if x})


def source_built_backends(entries: list) -> list:
    """Backends of these entries whose kernel package pip cannot install from a wheel (a
    source build): a runner that only has wheels lacks them, and says so."""
    return sorted({e["backend"] for e in entries if e["extra"] != e.get("wheel_extra", e["extra"])
                   or e["backend"] in _unextra_source_backends()})


def _unextra_source_backends() -> set:
    out = set()
    for cls in project_backends():
        if any(not p.wheel for p in cls.REQUIRED_PACKAGES):
            out.add(cls.NAME)
    return out


def _grouped(entries: list) -> list:
    """Entries of one profile merged over dtypes when the flags agree: (backend, dtypes, flags)."""
    groups: dict = {}
    for e in entries:
        key = (e["backend"], tuple(e[f] for f in FEATURES))
        groups.setdefault(key, []).append(e["dtype"])
    return [(b, dts, dict(zip(FEATURES, flags))) for (b, flags), dts in groups.items()]


def _yes(flag) -> str:
    return "yes" if flag else "no"


def _md_table(headers: list, rows: list) -> list:
    esc = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"] + \
           ["| " + " | ".join(r) + " |" for r in esc]


def matrix_markdown(profiles: list, registry=None) -> str:
    lines = []
    for p in profiles:
        entries = matrix_entries(p, registry)
        cc = f", compute capability {p.compute_capability[0]}.{p.compute_capability[1]}" if p.compute_capability else ""
        lines += [f"### {p.name} ({p.device_type}{cc})", ""]
        if p.hardware:
            lines += [f"Runner: {p.hardware}.", ""]
        if not entries:
            lines += ["No shipped backend declares this device.", ""]
            continue
        rows = [[b, ", ".join(dts)] + [_yes(flags[f]) for f in FEATURES] for b, dts, flags in _grouped(entries)]
        lines += _md_table(["backend", "dtypes", *FEATURES], rows) + [""]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------- docs
def _head_dims(cls) -> str:
    hi = cls.HEAD_DIM_MAX if cls.HEAD_DIM_MAX is not None else "any"
    text = f"{cls.HEAD_DIM_MIN}..{hi}"
    if cls.HEAD_DIM_MULTIPLE > 1:
        text += f", multiple of {cls.HEAD_DIM_MULTIPLE}"
    if cls.SUPPORTS_DIFFERENT_V_DIM:
        text += "; V may differ"
    return text


def _min_cc(cls) -> str:
    lo, hi = cls.MIN_COMPUTE_CAPABILITY or {}, cls.MAX_COMPUTE_CAPABILITY or {}
    parts = []
    for dev in sorted(set(lo) | set(hi)):
        a = f"{lo[dev][0]}.{lo[dev][1]}" if dev in lo else "any"
        b = f"{hi[dev][0]}.{hi[dev][1]}" if dev in hi else None
        parts.append(f"{dev} {a}" + ("" if b is None else " only" if b == a else f" to {b}"))
    return ", ".join(parts) or "-"


def _packages(cls) -> str:
    if not cls.REQUIRED_PACKAGES:
        return "torch only"
    parts = []
    for p in cls.REQUIRED_PACKAGES:
        text = f"`{p.dist}`" + (f" >= {p.min_version}" if p.min_version else "")
        if p.extra:
            text += f" (`usp-hal[{p.extra}]`)"
        parts.append(text)
    return ", ".join(parts)


# ----- cells decided per device by the backend's own not_supported_reasons
def _doc_base(cls, device_type: str):
    """A plain request on ``device_type`` with the first dtype the backend accepts there."""
    for dname in capability_row(cls)["dtypes"]:
        base = base_request(cls, device_type, parse_dtype(dname))
        if not cls.not_supported_reasons(base):
            return base
    return None


def _by_device(cls, value) -> str:
    """``value(base) -> str`` for each declared device; one value when all agree, otherwise
    "value (devices); value (devices)"."""
    per_dev: dict = {}
    for dev in sorted(cls.SUPPORTED_DEVICES):
        base = _doc_base(cls, dev)
        per_dev.setdefault(value(base) if base is not None else "none", []).append(dev)
    if len(per_dev) <= 1:
        return next(iter(per_dev), "-")
    return "; ".join(f"{v} ({', '.join(devs)})" for v, devs in per_dev.items())


def _accepts(cls, base, **change) -> bool:
    return not cls.not_supported_reasons(base.with_(**change))


def _feature_cell(feature: Feature):
    """A feature's row: the text of the first of its variants the backend accepts, "no" when
    none is (or the feature's own text where the change it needs is refused)."""
    def value(cls, base) -> str:
        if feature.needs is not None and not _accepts(cls, base, **feature.needs[0]):
            return feature.needs[1]
        for i, change in enumerate(feature.variants):
            if _accepts(cls, base, **change):
                text = feature.texts[i] if i < len(feature.texts) else "yes"
                return text(cls) if callable(text) else text
        return "no"
    return lambda cls: _by_device(cls, lambda base: value(cls, base))


def _dtypes_cell(cls) -> str:
    def accepted(base):
        return ", ".join(d for d in capability_row(cls)["dtypes"]
                         if _accepts(cls, base, dtype=parse_dtype(d)))
    return _by_device(cls, accepted)


def _across_blocks_cell(cls) -> str:
    def value(base):
        kinds = [feature_change(cls, base, "window"), feature_change(cls, base, "alibi")]
        usable = [k for k in kinds if k is not None]
        if not usable:
            return "n/a"
        return _yes(all(_accepts(cls, base, key_offset=True, **k) for k in usable))
    return _by_device(cls, value)


def _ulysses_only_cell(cls) -> str:
    return _by_device(cls, lambda b: "no" if feature_change(cls, b, "ring") is not None else "yes (no lse)")


def _varlen_cell(cls) -> str:
    if not cls.SUPPORTS_VARLEN:
        return "no"
    return "varlen kernel calls" if cls.VARLEN_KERNEL else "one call per document piece"


# (row label, cell for one backend class): the rows before the features', the rows that follow
# a feature's own row, and the rows after them all
_HEAD_ROWS = (
    ("devices", lambda c: ", ".join(sorted(c.SUPPORTED_DEVICES))),
    ("dtypes", _dtypes_cell),
    ("head dims", _head_dims),
)
_AFTER_FEATURE = {
    "ring": (("limited to Ulysses-only meshes", _ulysses_only_cell),),
    "window": (("window/alibi across ring blocks", _across_blocks_cell),),
    "gqa": (("packed documents (cu_seqlens)", _varlen_cell),),
}
_TAIL_ROWS = (
    ("compute capability", _min_cc),
    ("input strides taken as they are", lambda c: c.INPUT_LAYOUT),
    ("packages", _packages),
)


def _doc_rows() -> list:
    rows = list(_HEAD_ROWS)
    for feature in DECLARED:
        rows.append((feature.label, _feature_cell(feature)))
        rows += _AFTER_FEATURE.get(feature.name, ())
    return rows + list(_TAIL_ROWS)


def reason_text(reason: str) -> str:
    """A limit's reason with its placeholders spelled out for the docs."""
    for key, word in (("{version}", "<version>"), ("{torch}", "<torch>"), ("{cc}", "<smXY>"),
                      ("{model}", "<model>"), ("{head_dim}", "<D>")):
        reason = reason.replace(key, word)
    return reason


def generate_docs(registry=None) -> str:
    """The text of docs/backends.md (the same on every machine: declarations only, no machine facts)."""
    classes = project_backends(registry)
    names = [c.NAME for c in classes]
    lines = [
        f"<!-- Generated by `{DOCS_COMMAND}` from the backend declarations. Do not edit by hand. -->",
        "# Attention backends",
        "",
        f"Generated by `{DOCS_COMMAND}` from the capability declarations on each backend class "
        "(`backends/*.py`). After changing a declaration, run the command again; the test suite "
        "fails while this page is stale.",
        "",
        "`usp-hal probe` shows which of these are available on a given machine and why the others "
        "are not; `usp-hal probe --verify` runs the available ones against the float64 reference.",
        "",
        "## What each backend supports",
        "",
    ]
    rows = [[label] + [cell(c) for c in classes] for label, cell in _doc_rows()]
    lines += _md_table(["", *names], rows)
    lines += ["", "Notes:", ""]
    lines += [
        "- *ring (returns lse)*: ring degree > 1 merges partial results by their log-sum-exp; "
        "a backend without one serves Ulysses-only meshes and is refused for ring degree > 1.",
        "- *window/alibi across ring blocks*: the kernel takes the key position offset of an "
        "off-diagonal ring block; without it, windowed or alibi attention is refused for ring degree > 1.",
        "- Every cell is decided by the backend's own `not_supported_reasons`, per declared device; "
        "where devices differ the cell reads `value (devices); value (devices)`. Compute-capability "
        "limits are listed separately and applied per profile in the CI matrix below.",
        "- Rules that depend on the installed version of a kernel package are evaluated here with "
        "no kernel package installed; `usp-hal probe` and `usp-hal matrix` apply them on the machine "
        "itself.",
        "",
    ]
    for c in classes:
        lines.append(f"- **{c.NAME}**: {c.DESCRIPTION or '(no description)'}")
    lines += ["", "## Limits that depend on the version, the device or the lengths", "",
              "Declared on each backend class (`LIMITS`, `POSITIONS`) and applied by dispatch, by "
              "`usp-hal probe`, by the CI matrices and by every kernel call. Each names where the fact "
              "was read.", ""]
    rows = []
    for c in classes:
        for lim in c.LIMITS:
            rows.append([c.NAME, lim.condition(), reason_text(lim.reason), lim.source or "-"])
        pos = c.POSITIONS
        if pos.alignment != "top-left" or not pos.causal_any_lengths:
            what = (f"masks aligned {pos.alignment}"
                    + ("; causal only for Sq == Sk" if not pos.causal_any_lengths else
                       "; windows translated to the contract's top-left positions, refused when inexpressible")
                    + ("; alibi only for Sq == Sk" if not pos.alibi_any_lengths else "")
                    + ("; the kernel drops a right bound >= Sk (refused where that is wrong)"
                       if pos.right_unbounded_from == "seqlen_k" else ""))
            rows.append([c.NAME, "Sq != Sk", what, pos.source or "-"])
    lines += _md_table(["backend", "when", "what", "source"], rows) if rows else ["(none)"]
    lines += ["", "## What was checked against which upstream source", "",
              "Contract tests (`tests/contract/`) run each adapter against a stand-in package that copies "
              "these facts, on the CPU, including through `LongContextAttention` on gloo ranks. They prove "
              "the adapter, not the kernel; the per-device CI runs the real kernels.", ""]
    rows = [[c.NAME, fact, src] for c in classes for fact, src in c.UPSTREAM_CHECKED]
    lines += _md_table(["backend", "facts", "checked against"], rows) if rows else ["(none)"]
    lines += ["", "## What runs against the real kernel on a CPU", "",
              "Two kernels are Triton code, and Triton's interpreter (`TRITON_INTERPRET=1`) runs them on CPU "
              "tensors: `tests/real/` (part of every CI run, see `.ci/run` for the installs) and "
              "`usp-hal probe --verify --interpret` drive the real packages through the adapters and, in the tests, "
              "through `LongContextAttention`, against float64 attention. This proves the kernels' Python API and "
              "their arithmetic as the adapters drive them; it does not prove GPU races, tensor-core rounding or "
              "what masked loads return on the hardware (the interpreter gives zeros). Every other backend is "
              "checked on stand-ins only, until its per-device CI runs.", ""]
    rows = []
    for c in classes:
        facts = getattr(c, "INTERPRETER_CHECKED", ())
        if facts:
            rows += [[c.NAME, what, how] for what, how in facts]
        else:
            cpu = "cpu" in c.SUPPORTED_DEVICES
            rows.append([c.NAME, "its CPU kernels themselves" if cpu else "nothing: stand-ins only (tests/contract/)",
                         "its accelerator kernels (stand-ins only)" if cpu else "the kernel itself"])
    lines += _md_table(["backend", "checked against the real kernel here", "not checked here"], rows)
    lines += ["", *_verified_section(classes)]
    lines += ["", "## Per-device CI matrix", "",
              "What `usp-hal matrix --device PROFILE` generates for each CI profile: the dtypes each "
              "backend runs there and the features tested.", ""]
    lines.append(matrix_markdown(list(PROFILES.values()), registry).rstrip())
    return "\n".join(lines).rstrip() + "\n"


def _verified_section(classes) -> list:
    """Where each backend and feature was verified (:mod:`.verified`): per backend and
    declared device, each feature's tiers; ``refused`` where the declarations refuse it."""
    from . import verified as _v
    lines = ["## Where each feature was verified", "",
             "Per backend, declared device and feature: `stand-in` (contract tests against a stand-in package, "
             "`tests/contract/`), `interpreter` (the real Triton kernel under Triton's interpreter on a CPU, "
             "`tests/real/`), `cpu` (the real kernel on the CPU itself), `device` (the real kernel on an "
             "accelerator, by `ci/device-check.sh`). `refused`: the declarations refuse it there. "
             "Recorded in `usp_hal/harness/verified.py`.", ""]
    lines += _v.device_runs_text() + [""]
    rows = []
    for c in classes:
        for dev in sorted(c.SUPPORTED_DEVICES):
            base = _doc_base(c, dev)
            cells = []
            for f in _v.FEATURES:
                declared = base is not None and (f in ("packed", "module") or feature_change(c, base, f) is not None)
                if f == "packed" and not c.SUPPORTS_VARLEN:
                    declared = False
                got = _v.tiers(c.NAME, dev, f)
                cells.append(", ".join(got) if declared and got else ("refused" if not declared else "none"))
            rows.append([c.NAME, dev, *cells])
    return lines + _md_table(["backend", "device", *_v.FEATURES], rows)

