"""``usp-hal run`` and ``usp-hal bench`` end to end (spawned gloo ranks on 127.0.0.1),
plus the pure pieces they rely on: split resolution and the communication minimum."""
import json
import time

import pytest

from usp_hal.cli import main
from usp_hal.harness.cases import RunConfig, min_comm_bytes, resolve_split

pytestmark = pytest.mark.multirank


@pytest.mark.slow   # a whole CLI run: spawns its ranks
def test_run_small_two_ranks_passes(tmp_path, capsys):
    path = tmp_path / "run.json"
    rc = main(["run", "--seqlen", "64", "--heads", "4", "--head-dim", "16", "--iters", "2", "--warmup", "0",
               "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for field in ("ulysses 1 x ring 2", "backend    sdpa", "max abs error", "time per iteration",
                  "per rank", "kernel fwd", "peak memory per rank above its inputs", "minimum for this split",
                  "float64 usp_hal.dispatch.reference.reference_attention", "result: PASS"):
        assert field in out, (field, out)
    for name in ("out", "dq", "dk", "dv"):
        assert f"\n  {name} " in out, out
    res = json.loads(path.read_text())
    assert res["check"]["ok"] and res["check"]["mode"] == "fp64"
    assert set(res["check"]["errors"]) == {"out", "dq", "dk", "dv"}
    assert all(e["worst"] <= 1.0 for e in res["check"]["errors"].values())
    s = res["summary"]
    assert len(s["iter_times"]) == 2 and s["time"] > 0
    assert len(s["ranks"]) == 2 and all(r["kernel_fwd"] > 0 and r["kernel_bwd"] > 0 for r in s["ranks"])
    # zigzag splits causal work exactly: each rank scores 32*33/2 (own block) + 16*32 (the other's) pairs
    # per head, forward and backward
    assert s["work_balance"] == 1.0
    assert all(r["work"] == 2 * 4 * (32 * 33 // 2 + 16 * 32) for r in s["ranks"]), s["ranks"]
    # ring-2 p2p, fp32, B=1, 32 local tokens, 4 KV heads of 16: one K/V block is 2*32*4*16*4 bytes;
    # the minimum is that block forward, again backward, and its dK/dV home (fp32); a ring that
    # also sends the owner's own partial dK/dV on step 0 sends one block more
    kv = 2 * 32 * 4 * 16 * 4
    assert min_comm_bytes(RunConfig(**res["config"]))["total"] == 3 * kv
    for r in s["ranks"]:
        assert r["bytes"]["all_to_all_single"] == 0 and r["bytes"]["all_gather"] == 0, r["bytes"]
        assert r["bytes"]["batch_isend_irecv"] in (3 * kv, 4 * kv), r["bytes"]


def test_run_bad_split_fails_fast(capsys):
    t = time.monotonic()
    rc = main(["run", "--ulysses", "3", "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--ulysses 3" in err and "--nproc 2" in err
    assert time.monotonic() - t < 5


@pytest.mark.slow   # a whole CLI run: spawns its ranks
def test_run_refused_backend_fails_on_every_rank(capsys):
    t = time.monotonic()
    rc = main(["run", "--seqlen", "64", "--attn-type", "fa2", "--timeout", "120"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "every rank" in err and "fa2" in err and "sdpa" in err, err   # the reason and what would work
    assert time.monotonic() - t < 110                                      # an error, not the timeout


@pytest.mark.slow
def test_bench_tiny_sweep_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = main(["bench", "--seqlens", "64", "--heads", "4", "--head-dim", "16", "--modes", "fwdbwd",
               "--ring-impls", "zigzag", "--iters", "1", "--warmup", "0", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rep = json.loads(path.read_text())
    assert {"meta", "results", "baselines", "peers", "notes"} <= set(rep)
    assert [r["config"] for r in rep["results"]] == ["ulysses2", "ring2 zigzag p2p"]
    for r in rep["results"]:
        for key in ("time", "floor", "ratio_vs_floor", "single_same_threads", "ratio_vs_single_same_threads",
                    "kernel_balance", "sent_per_rank", "min_sent_per_rank", "sent_vs_min", "mem_per_rank",
                    "single_mem", "per_rank", "check"):
            assert key in r, (key, r)
        assert r["check"]["ok"] and r["time"] > 0 and len(r["per_rank"]) == 2
    uly = rep["results"][0]
    assert uly["sent_vs_min"] == pytest.approx(1.0)        # call metadata is counted apart
    assert set(rep["baselines"][0]) >= {"t1", "t2"}
    assert "ring2 zigzag p2p" in out and "x floor" in out


def test_resolve_split():
    assert resolve_split(None, None, None) == (2, 1, 2)
    assert resolve_split(4, 2, None) == (4, 2, 2)
    assert resolve_split(None, 2, 2) == (4, 2, 2)
    with pytest.raises(ValueError, match="--ring 3 does not divide --nproc 4"):
        resolve_split(4, None, 3)
    with pytest.raises(ValueError, match="= 4 ranks, but --nproc is 2"):
        resolve_split(2, 2, 2)


def test_min_comm_formulas():
    # Ulysses-4, fp32, H=Hkv=8, D=64, S=1024, B=1: each of q, k, v, out crosses 3/4 of its local bytes
    c = RunConfig(nproc=4, ulysses=4, ring=1, seqlen=1024, heads=8, kv_heads=8, head_dim=64, bwd=False)
    local = 256 * 8 * 64 * 4
    assert min_comm_bytes(c)["fwd"] == pytest.approx(0.75 * 4 * local)
    # MQA on Ulysses-2: each rank needs the single KV head, so K and V cross once each
    c = RunConfig(nproc=2, ulysses=2, ring=1, seqlen=1024, heads=8, kv_heads=1, head_dim=64, bwd=False)
    assert min_comm_bytes(c)["fwd"] == pytest.approx(0.5 * (2 * 512 * 8 * 64 * 4 + 2 * 2 * 512 * 64 * 4))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_runs_exit_cleanly_four_times():
    """``torchrun --nproc_per_node=2 -m usp_hal run --ulysses 2``: every one of 4 runs, two at
    a time (each on a free port: ``--standalone``; 4 ranks on 2 cores, a loaded machine), prints
    PASS and exits 0 (the ranks tear the process group down together)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")

    def start(i):
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 "--standalone", "-m", "usp_hal", "run", "--ulysses", "2",
                                 "--seqlen", "128", "--iters", "1", "--warmup", "0"],
                                cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for pair in range(2):
        runs = [(i, start(i)) for i in (2 * pair, 2 * pair + 1)]
        for i, proc in runs:
            try:
                out, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                for _, p in runs:
                    p.kill()
                raise
            assert proc.returncode == 0, f"run {i}: exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
            assert "result: PASS" in out, out[-2000:]
            assert "terminate called" not in err, err[-2000:]
