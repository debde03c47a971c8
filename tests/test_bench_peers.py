"""``usp-hal bench --peers``: yunchang gets usp-hal's kernel (on CPU through its
``attn_processor`` hook), is checked against the same float64 reference, and each row says
which kernel each side ran.  The yunchang parts skip when yunchang is not installed."""
import importlib.util
import json
import math

import pytest
import torch

from usp_hal.dispatch.reference import reference_attention
from usp_hal.harness.cases import CPU_PEER_KERNEL, usp_hal_kernel_label, yunchang_cpu_processor
from usp_hal.harness.sweep import PEER_MAX_CALLS, peer_ratios, round_order

HAS_YUNCHANG = importlib.util.find_spec("yunchang") is not None


def needs_yunchang(test):
    """Skipped, naming yunchang, where it is absent (not in the test extra: .ci/run's second tier)."""
    return pytest.mark.optional_pkg(pytest.mark.skipif(not HAS_YUNCHANG, reason="yunchang is not installed")(test))


def _qkv(s=48, sk=None, h=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sk or s
    return (torch.randn(2, s, h, d, generator=g), torch.randn(2, sk, h, d, generator=g),
            torch.randn(2, sk, h, d, generator=g))


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_processor_returns_out_bshd_and_lse_bhs(causal):
    q, k, v = _qkv()
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = yunchang_cpu_processor(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal,
                                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), softmax_scale=scale, causal=causal)
    assert out.shape == q.shape and lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_cpu_processor_refuses_what_it_cannot_run():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="plain attention"):
        yunchang_cpu_processor(q, k, v, window_size=(8, 0))


def test_kernel_labels():
    assert usp_hal_kernel_label("sdpa", "cpu", "fp32") == CPU_PEER_KERNEL
    assert "efficient" in usp_hal_kernel_label("sdpa", "cuda", "fp32")
    assert "FA2" in usp_hal_kernel_label("fa2", "cuda", "bf16")


def test_peer_ratios_of_medians_and_paired():
    r = peer_ratios([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    assert r["ratio_usp_hal_vs_peer"] == pytest.approx(1.0)
    assert r["ratio_peer_vs_usp_hal"] == pytest.approx(1.0)
    assert r["ratio_usp_hal_vs_peer_paired"] == pytest.approx(1.0)     # median of 0.5, 1, 1.5
    assert peer_ratios([1.0, 1.0], [4.0, 2.0])["ratio_usp_hal_vs_peer_paired"] == pytest.approx(0.375)
    q = peer_ratios([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5)
    assert (q["ratio_paired_q1"], q["ratio_usp_hal_vs_peer_paired"], q["ratio_paired_q3"]) == (2.0, 3.0, 4.0)
    assert peer_ratios([1.0], [2.0])["ratio_paired_q1"] is None


def test_rounds_rotate_and_swap_each_peer_with_usp_hals_bare_sample_every_other_round():
    entries = [("dist", 0), ("plain", 0), ("peer", 0), ("dist", 1), ("plain", 1), ("peer", 1), ("single", 1)]
    assert round_order(entries, 0) == entries
    assert round_order(entries, 1) == [("peer", 0), ("plain", 0), ("dist", 1), ("peer", 1), ("plain", 1),
                                       ("single", 1), ("dist", 0)]
    first = {0: set(), 1: set()}
    for rnd in range(2 * len(entries)):
        order = round_order(entries, rnd)
        assert sorted(order) == sorted(entries)                      # every entry once a round
        for i in (0, 1):
            a, b = order.index(("plain", i)), order.index(("peer", i))
            if abs(a - b) == 1:
                first[i].add("plain" if a < b else "peer")
    assert first == {0: {"plain", "peer"}, 1: {"plain", "peer"}}     # each side goes first in some rounds


def test_a_sample_is_the_slowest_rank_per_call_averaged_over_the_calls():
    from usp_hal.harness.sweep import _sample
    ranks = [[{"time": 1.0}, {"time": 4.0}], [{"time": 2.0}, {"time": 3.0}]]
    assert _sample(ranks) == pytest.approx(3.0)        # calls: max(1, 2) = 2, max(4, 3) = 4


def test_calls_per_sample_fill_the_sample_time_on_both_sides(monkeypatch):
    from usp_hal.harness import sweep

    class Pool:
        def run(self, fn, timeout, case, n, run):
            t = {"c0": 0.004, "p0": 0.006}[case]       # usp-hal 4 ms, the peer 6 ms: the slower decides
            return [[{"time": t}] * n, [{"time": t / 2}] * n]
    monkeypatch.setattr(sweep, "PEER_SAMPLE_S", 0.05)
    assert sweep._calls_per_sample(Pool(), 10.0, 0) == 9      # ceil(50 / 6)
    monkeypatch.setattr(sweep, "PEER_SAMPLE_S", 0.001)
    assert sweep._calls_per_sample(Pool(), 10.0, 0) == 1
    monkeypatch.setattr(sweep, "PEER_SAMPLE_S", 10.0)
    assert sweep._calls_per_sample(Pool(), 10.0, 0) == sweep.PEER_MAX_CALLS


def test_bare_usp_hal_calls_run_with_no_meter_then_restore_them(monkeypatch):
    """The usp-hal side of the peer comparison: no step hook, the backend's own methods
    (so binds_forward holds and a plan may bind its call), no collective wrapped; all back
    afterwards."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from usp_hal.harness import cases, meter
    from usp_hal.pipeline import run

    class Backend:
        def forward(self, *a, **k):
            return "out"

        def backward(self, *a, **k):
            return "grads"
    backend = Backend()
    times = meter.KernelTimes()
    meter.time_backend(backend, times)
    meter.instrument_core()
    seen = []

    def call():
        seen.append((meter.step_hook in run.HOOKS, "forward" in vars(backend), "backward" in vars(backend),
                     meter.ACTIVE["comm"]))
        return backend.forward(None, None, None)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    plan = SimpleNamespace(fast=None)
    attn = SimpleNamespace(last_backend=backend, pipeline=SimpleNamespace(plans={"p": plan}))
    monkeypatch.setitem(cases._CASES, "bare", SimpleNamespace(attn=attn, call=call,
                                                             cfg=SimpleNamespace(device_type="cpu")))
    try:
        recs = cases.rank_plain_steps("bare", 3)
        assert len(recs) == 3 and all(r["time"] >= 0 for r in recs)
        assert seen == [(False, False, False, None)] * 3 and times.fwd_calls == 0
        assert meter.step_hook in run.HOOKS and "forward" in vars(backend)
        backend.forward(None, None, None)
        assert times.fwd_calls == 1                     # the timer is back
        # a run: the calls back to back after one barrier, one record of the mean call
        del seen[:]
        run_recs = cases.rank_plain_steps("bare", 5, run=True)
        assert len(run_recs) == 1 and run_recs[0]["time"] >= 0 and len(seen) == 5
    finally:
        meter.uninstrument_core()


@needs_yunchang
def test_yunchang_takes_the_processor_and_merges_its_blocks_exactly():
    """The hook as yunchang's basic ring uses it: select_flash_attn_impl hands back the
    processor for an attn_type that is none of its members, and its merge of two key blocks
    (then its final lse transpose) gives full attention and its lse."""
    from yunchang.kernels import select_flash_attn_impl
    from yunchang.ring.utils import update_out_and_lse
    assert select_flash_attn_impl(None, stage="fwd-only", attn_processor=yunchang_cpu_processor) \
        is yunchang_cpu_processor
    q, k, v = _qkv(s=40, sk=64)
    scale = q.shape[-1] ** -0.5
    out = lse = None
    for kb, vb in zip(k.chunk(2, dim=1), v.chunk(2, dim=1)):
        bo, bl = yunchang_cpu_processor(q, kb, vb, softmax_scale=scale, causal=False)
        out, lse = update_out_and_lse(out, lse, bo, bl)
    lse = lse.squeeze(dim=-1).transpose(1, 2)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), softmax_scale=scale, causal=False)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


@needs_yunchang
def test_yunchang_kernel_choice_on_cpu():
    from usp_hal.harness.cases import yunchang_kernel
    basic = yunchang_kernel("cpu", "sdpa", "fp32", "basic")
    assert basic["attn_processor"] is yunchang_cpu_processor and basic["attn_type"] is None
    assert basic["same_kernel"] and CPU_PEER_KERNEL in basic["kernel"] and basic["skip"] is None
    zig = yunchang_kernel("cpu", "sdpa", "fp32", "zigzag")
    assert zig["skip"] and "attn_processor" in zig["skip"]


@needs_yunchang
@pytest.mark.multirank
def test_bench_peers_same_kernel_checked_and_named(tmp_path, capsys):
    from usp_hal.cli import main
    path = tmp_path / "bench.json"
    rc = main(["bench", "--seqlens", "64", "--heads", "4", "--head-dim", "16", "--splits", "2x1,1x2",
               "--ring-impls", "basic,zigzag", "--modes", "fwd", "--causal", "both", "--peers", "--no-baseline",
               "--iters", "2", "--warmup", "0", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rep = json.loads(path.read_text())
    ok = [p for p in rep["peers"] if p["status"] == "ok"]
    assert sorted((p["causal"], p["config"]) for p in ok) == [
        (False, "ring2 basic p2p"), (False, "ulysses2"), (True, "ring2 basic p2p"), (True, "ulysses2")]
    for p in ok:
        assert p["same_kernel"] and CPU_PEER_KERNEL in p["kernel"] and p["usp_hal_kernel"] == CPU_PEER_KERNEL
        assert p["check_mode"] == "fp64" and p["correct"] and p["error_worst"] <= 1.0, p
        assert len(p["iter_times"]) == 2 and p["ratio_usp_hal_vs_peer"] > 0
        assert len(p["usp_hal_iter_times"]) == 2 and 1 <= p["calls_per_sample"] <= PEER_MAX_CALLS
        # the bare calls take the user's path: Ulysses-2 forward without lse binds its plan
        assert p["ratio_usp_hal_vs_peer_paired"] > 0
        assert p["ratio_paired_q1"] <= p["ratio_usp_hal_vs_peer_paired"] <= p["ratio_paired_q3"]
    skipped = [p for p in rep["peers"] if p["status"] == "skipped"]
    assert {p["config"] for p in skipped} == {"ring2 zigzag p2p"} and len(skipped) == 2
    assert "attn_processor" in skipped[0]["note"]
    assert CPU_PEER_KERNEL in out and "usp/peer" in out and "paired" in out
