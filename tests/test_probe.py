"""`usp-hal probe`: report shape, availability reasons, --verify, and the text table."""
from __future__ import annotations

import json
import re

import pytest
import torch

from usp_hal.backends.sdpa import SDPABackend
from usp_hal.cli import main, probe
from usp_hal.dispatch import platform
from usp_hal.dispatch.backend import AttentionBackend
from usp_hal.dispatch.reference import TOLERANCES
from usp_hal.dispatch.registry import NO_BACKEND, AttnType, Registry
from usp_hal.harness import verify

DOCUMENTED = {t.value for t in AttnType} - {"auto"} - set(NO_BACKEND)   # the built-in names of the public API
CPU_ONLY = platform.available_device_types() == ("cpu",)


def _strict_json(text: str):
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name} in probe output")
    return json.loads(text, parse_constant=no_constants)


def _run(capsys, *argv):
    rc = main(["probe", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def report_json():
    """One --json run shared by the shape tests (the probe itself is cheap; this keeps it so)."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["probe", "--json"])
    assert rc == 0
    return _strict_json(buf.getvalue())


def test_json_top_level_keys(report_json):
    assert {"torch", "platform", "dist_backends", "backends"} <= set(report_json)
    assert "verify" not in report_json
    assert report_json["torch"]["version"] == torch.__version__
    assert report_json["platform"]["device_type"] in platform.DEVICE_TYPES
    assert "cpu" in report_json["platform"]["device_types"]
    assert report_json["dist_backends"]["gloo"] is platform.dist_backend_available("gloo")
    assert all(isinstance(v, bool) for v in report_json["dist_backends"].values())


def test_json_lists_every_registered_backend(report_json):
    names = [b["name"] for b in report_json["backends"]]
    assert DOCUMENTED <= set(names)
    assert len(names) == len(set(names))
    for row in report_json["backends"]:
        assert set(row) >= {"name", "available", "reason", "version", "capabilities"}
        assert isinstance(row["available"], bool)
        if row["available"]:
            assert row["reason"] == ""
        else:
            assert row["reason"].strip(), f"{row['name']} is unavailable without a reason"


def test_sdpa_available_with_declared_capabilities(report_json):
    row = next(b for b in report_json["backends"] if b["name"] == "sdpa")
    assert row["available"] is True
    caps = row["capabilities"]
    assert caps["dtypes"] == ["fp64", "fp32", "bf16", "fp16"]
    assert caps["devices"] == sorted(SDPABackend.SUPPORTED_DEVICES)
    assert caps["backward"] is SDPABackend.HAS_BACKWARD
    assert caps["lse"] is SDPABackend.RETURNS_LSE
    assert caps["softcap"] is SDPABackend.SUPPORTS_SOFTCAP
    assert caps["gqa"] is SDPABackend.SUPPORTS_GQA


@pytest.mark.skipif(not CPU_ONLY, reason="only a CPU-only machine makes every kernel backend unavailable")
def test_kernel_backends_unavailable_on_cpu_with_reasons(report_json):
    for row in report_json["backends"]:
        if row["name"] in ("sdpa", "flex", "portable"):      # torch's own CPU kernels, plain torch
            continue
        assert row["available"] is False, row
        assert len(row["reason"]) > 5


def test_import_failure_and_raising_availability_are_reasons_not_crashes():
    class Raises(AttentionBackend):
        NAME = "raises"
        SUPPORTED_DEVICES = frozenset({"cpu"})
        SUPPORTED_DTYPES = frozenset({torch.float32})

        @classmethod
        def availability(cls):
            raise OSError("driver exploded")

    reg = Registry()
    reg.register("broken", "usp_hal.backends._no_such_adapter:Nothing")
    reg.register("raises", Raises)
    rows = {r["name"]: r for r in verify.backend_rows(reg)}
    assert rows["broken"]["available"] is False
    assert "failed to import" in rows["broken"]["reason"]
    assert "_no_such_adapter" in rows["broken"]["reason"]
    assert rows["broken"]["capabilities"] == {}
    assert rows["raises"]["available"] is False
    assert "OSError: driver exploded" in rows["raises"]["reason"]
    assert rows["raises"]["capabilities"]["dtypes"] == ["fp32"]
    # the text output survives both
    report = {"usp_hal": "x", "torch": {"version": "t", "cuda": None, "hip": None, "xpu": None},
              "platform": {"device_type": "cpu", "device_types": ["cpu"], "device_count": 1,
                           "device_name": "cpu", "compute_capability": None},
              "dist_backends": {"gloo": True}, "backends": list(rows.values())}
    text = probe.format_text(report)
    assert re.search(r"^broken\s+no\s+-\s+\?", text, re.M)
    assert "driver exploded" in text


def test_plain_output_is_an_aligned_table(capsys):
    rc, out, _ = _run(capsys)
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    cols = ["available", "version", "fwd", "bwd", "lse(ring)", "causal", "window", "softcap", "gqa",
            "dtypes", "devices", "min cc"]
    starts = [lines[header].index(c) for c in cols]
    assert starts == sorted(starts)
    sdpa = next(line for line in lines[header:] if line.startswith("sdpa "))
    assert sdpa[starts[0]:].startswith("yes")                       # available column
    assert sdpa[starts[cols.index("dtypes")]:].startswith("fp64,fp32,bf16,fp16")
    for name in DOCUMENTED:
        assert re.search(rf"^{name}\s", out, re.M), f"{name} missing from the table"
    assert "torch" in out and torch.__version__ in out
    if CPU_ONLY:
        assert "Unavailable here:" in out
        reasons = out.split("Unavailable here:")[1]
        for name in DOCUMENTED - {"sdpa"}:
            assert re.search(rf"^\s+{name}\s+\S", reasons, re.M)


def test_verify_passes_for_sdpa(capsys):
    rc, out, _ = _run(capsys, "--verify", "--json", "--backend", "sdpa")
    assert rc == 0
    data = _strict_json(out)
    v = data["verify"]
    assert v["ok"] is True
    res = v["results"]
    assert {r["backend"] for r in res} == {"sdpa"}
    assert {r["dtype"] for r in res} == {"fp64", "fp32", "bf16", "fp16"}
    ran = [r for r in res if r["status"] != "skip"]
    # every feature the declarations accept (the CI matrix entries run the same cases)
    assert {r["case"] for r in ran} == {"plain", "causal", "gqa-causal", "window"}
    for r in res:
        if r["status"] == "skip":     # only on an accelerator: sdpa runs fp64 on the cpu alone
            assert not CPU_ONLY and r["dtype"] == "fp64" and r["reason"], r
            continue
    for r in ran:
        assert r["status"] == "pass", r
        assert set(r["errors"]) == {"out", "lse", "dq", "dk", "dv"}
        atol = r["tolerance"][0]
        assert all(0 <= e <= 2 * atol for e in r["errors"].values()), r


def test_verify_text_reports_pass(capsys):
    rc, out, _ = _run(capsys, "--verify", "--backend", "sdpa", "--dtype", "fp32")
    assert rc == 0
    assert "verification: PASSED" in out
    assert re.search(r"^sdpa\s+(cpu|cuda|rocm)\s+fp32\s+causal\s+\S+\s+\S+\s+\S+\s+\S+\s+\S+\s+pass$", out, re.M)


class _WrongOut(SDPABackend):
    """A kernel that is silently wrong: verification must catch it."""
    NAME = "wrong"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})

    def forward(self, q, k, v, call):
        out, lse = super().forward(q, k, v, call)
        return out * 1.01, lse


class _NoFp64HereBackend(SDPABackend):
    NAME = "nofp64"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float64, torch.float32})
    HAS_BACKWARD = False
    SUPPORTS_GQA = False

    @classmethod
    def extra_reasons(cls, req):
        return ["fp64 disabled for this test"] if req.dtype == torch.float64 else []


def test_verify_failure_sets_exit_code(capsys, monkeypatch):
    reg = Registry()
    reg.register("wrong", _WrongOut)
    monkeypatch.setattr(verify, "REGISTRY", reg)
    rc, out, _ = _run(capsys, "--verify", "--backend", "wrong")
    assert rc == 1
    assert "verification: FAILED" in out
    assert "out: exceeds tolerance" in out


def test_verify_skips_refused_dtypes_and_undeclared_features():
    rows = verify.verify_backend(_NoFp64HereBackend, "cpu")
    by_dtype = {}
    for r in rows:
        by_dtype.setdefault(r["dtype"], []).append(r)
    (fp64,) = by_dtype["fp64"]
    assert fp64["status"] == "skip" and "fp64 disabled" in fp64["reason"]
    fp32 = by_dtype["fp32"]
    assert {r["case"] for r in fp32} == {"plain", "causal", "window"}      # no GQA declared
    for r in fp32:
        assert r["status"] == "pass"
        assert set(r["errors"]) == {"out", "lse"}                 # forward-only: no grads checked


def test_verify_requested_unavailable_backend_fails(capsys, monkeypatch):
    class NeedsPkg(SDPABackend):
        NAME = "needspkg"
        from usp_hal.dispatch.capabilities import Package
        REQUIRED_PACKAGES = (Package("usp-hal-no-such-dist", "usp_hal_no_such_module", extra="nope"),)

    reg = Registry()
    reg.register("needspkg", NeedsPkg)
    monkeypatch.setattr(verify, "REGISTRY", reg)
    rc, out, _ = _run(capsys, "--verify", "--backend", "needspkg", "--json")
    assert rc == 1
    (res,) = _strict_json(out)["verify"]["results"]
    assert res["status"] == "fail"
    assert "usp-hal-no-such-dist not installed" in res["reason"]


def test_unknown_backend_name_is_a_usage_error(capsys):
    rc, _, err = _run(capsys, "--verify", "--backend", "nope")
    assert rc == 2
    assert "valid options are" in err and "sdpa" in err


def test_auto_is_not_a_backend_to_verify(capsys):
    rc, _, err = _run(capsys, "--verify", "--backend", "auto")
    assert rc == 2 and "'auto' is not a backend" in err


def test_backend_filter_needs_verify(capsys):
    rc, _, err = _run(capsys, "--backend", "sdpa")
    assert rc == 2 and "--verify" in err


def test_features_come_from_not_supported_reasons():
    base = verify.base_request(SDPABackend, "cpu", torch.float32)
    feats = verify.supported_features(SDPABackend, base)
    assert set(feats) == set(verify.FEATURES)
    assert feats == {"fwd": True, "bwd": True, "ring": True, "causal": True, "window": True,
                     "softcap": False, "gqa": True}
    # device-specific rules (declared Limits) are honoured: sdpa refuses fp64 off the cpu
    cuda64 = verify.base_request(SDPABackend, "cuda", torch.float64, (9, 0))
    assert SDPABackend.not_supported_reasons(cuda64)


def test_base_request_picks_a_declared_head_dim():
    class Only128(AttentionBackend):
        NAME = "only128"
        SUPPORTED_DEVICES = frozenset({"cpu"})
        SUPPORTED_DTYPES = frozenset({torch.float32})
        HEAD_DIM_MIN = 100
        HEAD_DIM_MAX = 200
        HEAD_DIM_MULTIPLE = 64

    assert verify.base_request(Only128, "cpu", torch.float32).head_dim == 128
    refused = verify.base_request(Only128, "cpu", torch.float16)
    assert Only128.not_supported_reasons(refused)


class _LeftWindowOnly(SDPABackend):
    """Accepts a sliding window only as a causal left bound (like FlashInfer)."""
    NAME = "leftwin"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})

    @classmethod
    def extra_reasons(cls, req):
        return ["right window bound without causal"] if req.window[1] >= 0 and not req.causal else []


def test_window_variant_falls_back_to_causal_left_bound():
    base = verify.base_request(_LeftWindowOnly, "cpu", torch.float32)
    assert verify.feature_change(_LeftWindowOnly, base, "window") == {"window": verify.VERIFY_LEFT_WINDOW,
                                                                     "causal": True}
    assert verify.feature_change(SDPABackend, base, "window") == {"window": verify.VERIFY_WINDOW}
    rows = verify.verify_backend(_LeftWindowOnly, "cpu", features={"window": True, "bwd": True, "ring": True})
    assert [(r["case"], r["status"]) for r in rows] == [("plain", "pass"), ("window-causal", "pass")]
    with pytest.raises(ValueError, match="unknown feature"):
        verify.feature_change(SDPABackend, base, "telepathy")


class _Lossy(_WrongOut):
    """A lossy kernel that declares its accuracy: verified against its own tolerances."""
    NAME = "lossy"
    LOSSY_TOLERANCES = {torch.float32: (0.2, 0.05)}


def test_lossy_backend_is_verified_against_its_declared_tolerances():
    assert verify.tolerances_for(SDPABackend, torch.bfloat16) == TOLERANCES[torch.bfloat16]
    assert verify.tolerances_for(_Lossy, torch.float32) == (0.2, 0.05)
    rows = verify.verify_backend(_Lossy, "cpu")
    assert rows and all(r["status"] == "pass" and r["tolerance"] == [0.2, 0.05] for r in rows)
    # the same error fails at the reference tolerances
    assert all(r["status"] == "fail" for r in verify.verify_backend(_WrongOut, "cpu"))


# ----------------------------------------------------------------------------- per-backend summary
def _report(rows, results):
    return {"backends": rows, "verify": {"ok": True, "results": results}}


def _row(name, available=True, reason=""):
    return {"name": name, "available": available, "reason": reason}


def _res(name, status, reason="", case="plain", dtype="fp16"):
    return {"backend": name, "status": status, "reason": reason, "case": case, "dtype": dtype}


def test_summary_says_verified_refused_unavailable_failed_or_timeout():
    report = _report(
        [_row("a"), _row("b"), _row("c", False, "kernel not installed"), _row("d"), _row("e")],
        [_res("a", "pass"), _res("a", "skip", "no window here", case="window"),
         _res("b", "skip", "device model x not supported"),
         _res("d", "pass"), _res("d", "fail", "out: exceeds tolerance", case="causal"),
         _res("e", "timeout", "verification did not finish within 5 s")])
    got = {r["backend"]: (r["status"], r["detail"]) for r in verify.summarize(report)}
    assert got["a"][0] == "verified" and "1 case(s) pass" in got["a"][1] and "no window here" in got["a"][1]
    assert got["b"] == ("refused", "device model x not supported")
    assert got["c"] == ("unavailable", "kernel not installed")
    assert got["d"][0] == "failed" and "causal: out: exceeds tolerance" in got["d"][1]
    assert got["e"][0] == "timeout"


def test_verify_with_a_time_limit_runs_each_backend_in_its_own_process(capsys):
    report = verify.collect(verify=True, only=["sdpa"], dtypes=[torch.float32], timeout=120)
    summary = {r["backend"]: r["status"] for r in report["summary"]}
    assert summary["sdpa"] == "verified" and report["verify"]["ok"]
    assert all(r["backend"] == "sdpa" and r["status"] == "pass" for r in report["verify"]["results"])
    report = verify.collect(verify=True, only=["sdpa"], dtypes=[torch.float32], timeout=0.01)
    assert [r["status"] for r in report["verify"]["results"]] == ["timeout"]
    assert not report["verify"]["ok"]
    assert {r["backend"]: r["status"] for r in report["summary"]}["sdpa"] == "timeout"


def test_text_output_ends_with_the_per_backend_lines(capsys):
    rc, out, _ = _run(capsys, "--verify", "--backend", "sdpa", "--dtype", "fp32")
    assert rc == 0
    assert "Per backend (verified, refused, unavailable, failed, timeout):" in out
    assert re.search(r"^\s+sdpa\s+verified: \d+ case\(s\) pass", out, re.M)


def test_a_backward_refused_on_this_device_is_shown_as_such(capsys):
    # flex has a backward on CUDA but torch's CPU flex raises for inputs that require grad: the
    # probe must not print "yes" for it on a CPU machine
    rows = {r["name"]: r for r in verify.backend_rows()}
    flex = rows.get("flex")
    if flex is None or not flex["available"] or flex["device"] != "cpu":
        pytest.skip("flex is not available on a CPU here")
    assert flex["capabilities"]["backward"] and flex["here"]["backward"] is False
    assert "backward on CPU" in flex["here"]["backward_reason"]
    assert rows["sdpa"]["here"]["backward"] is True
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("flex "))
    assert "no on cpu" in line, line
    assert "Limits on this machine's device:" in out
