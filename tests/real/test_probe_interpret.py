"""``usp-hal probe --verify --interpret``: the Triton kernels verified under the interpreter,
only when asked for, in processes of their own."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from usp_hal.backends import interpret
from usp_hal.cli.probe import add_parser, run
from usp_hal.harness.verify import collect

pytestmark = pytest.mark.real_kernel


def _args(*argv):
    import argparse
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["probe", *argv])


def test_interpret_needs_verify(capsys):
    assert run(_args("--interpret")) == 2
    assert "--interpret only apply with --verify" in capsys.readouterr().err


def test_interpret_refuses_backends_without_a_triton_kernel():
    with pytest.raises(ValueError, match="--interpret runs Triton kernels only"):
        collect(verify=True, interpret=True, only=["sdpa"])


def test_plain_verify_never_interprets():
    report = collect(verify=True, only=["sdpa"])
    assert not any(r.get("interpreted") for r in report["verify"]["results"])
    assert "interpreted" not in report["verify"]


def test_interpret_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(interpret, "missing", lambda name: "triton is not installed (stand-in reason)")
    report = collect(verify=True, interpret=True, only=["fa2"])
    (row,) = report["verify"]["results"]
    assert row["status"] == "fail" and "triton is not installed" in row["reason"] and not report["verify"]["ok"]


@pytest.mark.parametrize("name", ["sage_fp8", "fa2"])
def test_probe_verify_interpret_passes_on_the_real_kernel(name):
    why = interpret.missing(name)
    if why:
        pytest.skip(f"{name} under the Triton interpreter: {why}")
    res = subprocess.run([sys.executable, "-m", "usp_hal", "probe", "--verify", "--interpret", "--json",
                          "--backend", name], capture_output=True, text=True, timeout=600)
    report = json.loads(res.stdout)
    rows = report["verify"]["results"]
    assert res.returncode == 0 and report["verify"]["ok"], rows
    assert all(r["interpreted"] for r in rows) and any(r["status"] == "pass" for r in rows), rows
    summary = {r["backend"]: r for r in report["summary"]}[name]
    assert summary["status"] == "verified" and "Triton interpreter" in summary["detail"]
