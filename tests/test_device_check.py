"""ci/device-check.sh --dry-run: the device check's own script and code on the CPU, so it
cannot rot between GPU runs.  Every check is listed in the report; those that need CUDA are
skipped by name; the others run here and pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ci"))
import device_check as dc  # noqa: E402  (ci/device_check.py)


def test_first_call_spelling_matches_this_tree():
    import inspect

    from usp_hal import LongContextAttention
    kw = dc.first_call_kwargs()
    params = inspect.signature(LongContextAttention.__init__).parameters
    assert set(kw) <= set(params)
    assert kw in ({"static_shapes": True}, {"check_ranks": "first_call"})


def test_check_names_are_unique_and_each_says_what_it_needs():
    names = [c.name for c in dc.CHECKS]
    assert len(names) == len(set(names))
    assert all(c.needs in ("", "cuda") for c in dc.CHECKS)
    # the CUDA-only parts the issue lists are all there
    for want in ("kernel/sdpa-op/flash/bf16", "kernel/sdpa-op/cudnn/fp16", "kernel/sage_fp8/module",
                 "kernel/flex/mask-sinks", "multirank/4/U2xR2", "multirank/2/R2-allgather", "multirank/2/U2-fp8",
                 "multirank/2/U2-async", "multirank/2/R2-packed", "multirank/2/R2-mask", "sync/steady/U2R1",
                 "cuda-graph/forward", "timing/host-vs-kernel", "timing/flash-tflops"):
        assert want in names


def test_a_wrong_kernel_fails_the_kernel_case(monkeypatch):
    """The comparison can fail: a kernel off by 1% is caught, forward and through the module."""
    good = dc.kernel_case("cpu", "sdpa", torch.float32, causal=True, s=19, h=4, hkv=2, d=8, grad=True, lse=True,
                          through_module=True)
    assert good["ok"], good
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def off(*args, **kwargs):
        out, lse = op(*args, **kwargs)
        return out * 1.01, lse
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", off)
    for through in (False, True):
        bad = dc.kernel_case("cpu", "sdpa", torch.float32, causal=True, s=19, h=4, hkv=2, d=8, grad=False,
                             lse=True, through_module=through)
        assert not bad["ok"] and not bad["out"]["ok"], bad


# checks that run on the CPU too but need a package the test extra leaves out (fla: .ci/run's second tier)
NEEDS_A_PACKAGE = {"multirank/2/fla-gdn-state-passing", "multirank/2/fla-kda-state-passing"}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_dry_run_lists_every_check_and_the_cpu_ones_pass(tmp_path):
    out = tmp_path / "dc"
    t0 = time.monotonic()
    res = subprocess.run(["bash", os.path.join(ROOT, "ci", "device-check.sh"), str(out), "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=840, env={**os.environ, "PYTHON": sys.executable})
    took = time.monotonic() - t0
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    report = json.loads((out / "device-check.json").read_text())
    rows = {r["name"]: r for r in report["checks"]}
    assert report["dry_run"] and report["device"] == "cpu"
    for c in dc.CHECKS:
        assert c.name in rows, f"{c.name} missing from the report"
        row = rows[c.name]
        if c.needs == "cuda":
            assert row["status"] == "skip" and "needs CUDA" in row["detail"], row
            assert f"SKIP  {c.name} " in text, f"{c.name} not printed as skipped"
        elif row["status"] == "skip" and c.name in NEEDS_A_PACKAGE:     # skipped by name, as the tests do
            assert "is not installed" in row["detail"], row
        else:
            assert row["status"] in ("pass", "info"), row
    for step, want in (("step/install", "skip"), ("step/probe", "pass"), ("step/matrix", "pass"),
                       ("step/probe-verify", "pass")):
        assert rows[step]["status"] == want, rows[step]
    table = (out / "device-check.txt").read_text()
    assert all(name in table for name in rows)
    for f in ("probe.json", "matrix-cuda-sm90.json", "matrix-cuda-sm90.md", "verify.json"):
        assert (out / f).stat().st_size > 0, f
    print(f"device-check.sh --dry-run took {took:.0f} s")


def test_the_nonfinite_check_fails_without_the_guard(monkeypatch, tmp_path):
    """kernel/sdpa/nonfinite records what the kernel does with a non-finite query and checks the
    module's rows whatever that is.  The kernel's behaviour is arranged here, not taken from this
    CPU (torch's CPU op carries a NaN query row on some machines and hides it on others): a
    stand-in of the CPU op hides every non-finite query row.  The check passes (the core guards
    the rows), records that the kernel does not carry them, and fails once the sdpa backend
    claims its CPU kernel carries them (the core then adds no guard)."""
    from usp_hal.dispatch.registry import REGISTRY
    ctx = dc.Context("cpu", str(tmp_path), True)
    real = dc.check_nonfinite(ctx)           # this machine's kernel: any facts, the module's rows exact
    assert real["status"] == "pass", real
    for case in real["data"].values():
        assert set(case["facts"]) == {"adapter_out_carries", "adapter_lse_carries"}, case
        assert all(isinstance(v, bool) for v in case["facts"].values()), case

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def hiding(q, k, v, *args, **kwargs):    # a kernel that returns finite rows for a NaN/inf query
        return op(q.masked_fill(~torch.isfinite(q).all(-1, keepdim=True), 0.0), k, v, *args, **kwargs)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", hiding)
    good = dc.check_nonfinite(ctx)
    assert good["status"] == "pass", good
    for name, case in good["data"].items():
        assert case["facts"] == {"adapter_out_carries": False, "adapter_lse_carries": False}, (name, case)
    monkeypatch.setattr(REGISTRY.get("sdpa"), "PROPAGATES_NAN", frozenset({"cpu"}))
    bad = dc.check_nonfinite(ctx)
    assert bad["status"] == "fail" and "S8" in bad["detail"] and "S37" in bad["detail"], bad
