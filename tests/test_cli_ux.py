"""The CLI on long runs and in pipes: run prints a header and progress on stderr, bench --plot
without matplotlib fails before running, plan states its assumptions and the integration
lines, and a closed pipe ends it quietly."""
import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from usp_hal.cli import main

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--world", "8", "--heads", "24", "--seqlen", "4608", "--head-dim", "128"]


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_plan_states_its_assumptions_first_and_prints_the_integration_lines():
    rc, text, _ = _main(PLAN)
    assert rc == 0
    head = text.splitlines()[:4]
    assert head[0].startswith("assumptions"), head
    assert "cpu  [default" in head[1] and "forward only  [default" in head[2] and "not causal" in head[3], head
    assert "usp.register(layout=" in text and "usp.parallelize(pipe.transformer, mesh" in text
    assert "usp.init_distributed(ulysses_degree=" in text
    rc, text, _ = _main(PLAN + ["--profile", "h100-nvlink", "--bwd", "--causal"])
    head = text.splitlines()[:4]
    assert "h100-nvlink" in head[1] and "forward+backward" in head[2] and "causal" in head[3], head
    assert not any("[default" in ln for ln in head), head          # nothing was assumed
    rc, text, _ = _main(PLAN + ["--json"])
    data = json.loads(text)
    assert data["assumptions"]["profile"] == {"value": "cpu", "default": True}
    assert data["assumptions"]["pass"]["default"] and data["integrations"]


def test_plan_json_into_a_closed_pipe_exits_quietly():
    cmd = f"{sys.executable} -m usp_hal plan {' '.join(PLAN[1:])} --json | head -2"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.stdout.startswith("{"), out.stdout


def test_bench_plot_without_matplotlib_fails_before_running(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc, out, err = _main(["bench", "--seqlens", "64", "--plot", "/tmp/never.png"])
    assert rc == 2, (out, err)
    assert "matplotlib is not installed" in err and "[bench]" in err, err
    assert not out, out          # nothing ran


@pytest.mark.slow
@pytest.mark.multirank
def test_run_prints_a_header_and_progress_on_stderr():
    cmd = [sys.executable, "-m", "usp_hal", "run", "--seqlen", "128", "--heads", "2", "--head-dim", "16",
           "--iters", "1", "--check", "fp64"]
    # the plain and the --quiet run side by side (each mostly starts Python processes)
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
             for c in (cmd, cmd + ["--quiet"])]
    try:
        (stdout, stderr), (_, quiet_err) = (p.communicate(timeout=300) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, stderr[-2000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("usp-hal run:")]
    assert lines and "ulysses" in lines[0] and "S=128" in lines[0], stderr[-2000:]
    assert "finished in" in lines[-1], lines
    assert "result: PASS" in stdout
    assert procs[1].returncode == 0 and not any(ln.startswith("usp-hal run:") for ln in quiet_err.splitlines())


RUN = ["run", "--nproc", "2", "--seqlen", "64", "--heads", "2", "--head-dim", "8", "--iters", "1", "--quiet"]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fails the test if the command gets as far as spawning ranks."""
    from usp_hal.harness import pool

    def spawn(*a, **k):
        raise AssertionError("ranks were spawned: the arguments were not refused up front")
    monkeypatch.setattr(pool, "RankPool", spawn)


@pytest.mark.parametrize("argv, flag", [
    (PLAN + ["--kv-heads", "0"], "--kv-heads"),
    (PLAN + ["--docs", "0"], "--docs"),
    (PLAN + ["--gpus-per-node", "0"], "--gpus-per-node"),
    (RUN + ["--kv-heads", "0"], "--kv-heads"),
    (RUN + ["--docs", "0"], "--docs"),
    (RUN + ["--timeout", "0"], "--timeout"),
    (RUN + ["--timeout", "-5"], "--timeout"),
    (RUN + ["--ulysses", "2", "--ring", "1", "--ring-fp8"], "--ring-fp8"),
    (RUN + ["--json", "/nonexistent-folder/x/out.json"], "--json"),
    (["bench", "--kv-heads", "0", "--seqlens", "64"], "--kv-heads"),
    (["bench", "--timeout", "0", "--seqlens", "64"], "--timeout"),
])
def test_cli_refuses_numbers_and_paths_that_a_default_would_hide_in_one_line(argv, flag, no_ranks, tmp_path):
    rc, out, err = _main(argv)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert flag in err, err
    assert not out, out


def test_plan_with_a_profile_that_is_not_json_is_a_one_line_error(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not json\n")
    for text in ("this is not json\n", "[1, 2]\n", "\xff\xfe"):
        bad.write_bytes(text.encode("latin-1"))
        rc, out, err = _main(PLAN + ["--profile", str(bad)])
        assert rc == 2, (rc, out, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and str(bad) in err, err
