"""The Ulysses x Ring degree per global batch: the schedule (one process) and its run on 4 gloo
ranks against float64 attention of each sequence alone."""
import pytest

from tests import dist_dynamic
from usp_hal.schedule import AttentionShape, ScheduleError, group_sizes, schedule_batch, static_schedule

SHAPE = AttentionShape(heads=8, head_dim=64, kv_heads=2, dtype="bf16", causal=True, bwd=True)


def _check_placement(sched, lengths, world, budget):
    placed = sorted(i for j in sched.jobs for i in j.seqs)
    assert placed == list(range(len(lengths))), "every sequence exactly once"
    for j in sched.jobs:
        assert j.size in group_sizes(world) and j.first % j.size == 0 and j.first + j.size <= world, j
        assert j.cost.ulysses * j.cost.ring == j.size, j
        assert j.lengths == tuple(lengths[i] for i in j.seqs), j
        assert -(-sum(j.lengths) // j.size) <= budget, f"over the budget: {j}"
        if len(j.seqs) > 1:
            assert j.size == 1, "only what a rank holds alone is packed"


def test_group_sizes():
    assert group_sizes(1) == (1,)
    assert group_sizes(4) == (1, 2, 4)
    assert group_sizes(6) == (1, 2, 6)
    assert group_sizes(8) == (1, 2, 4, 8)
    with pytest.raises(ScheduleError):
        group_sizes(0)


def test_short_sequences_run_alone_without_sequence_parallelism():
    lengths = [300, 280, 260, 240, 220, 200, 180, 160]
    s = schedule_batch(lengths, 4, SHAPE, budget_tokens=1024, profile="h100-nvlink")
    _check_placement(s, lengths, 4, 1024)
    assert all(j.size == 1 and (j.cost.ulysses, j.cost.ring) == (1, 1) for j in s.jobs)
    assert max(s.per_rank("bytes")) == 0 and max(s.per_rank("collectives")) <= 2
    assert len(s.jobs) == 4, "each rank's sequences packed into one job"


def test_three_degrees_in_one_step_and_each_within_the_budget():
    lengths = [3800, 1900, 1700, 600, 500, 400, 300, 300, 200, 100]
    s = schedule_batch(lengths, 4, SHAPE, budget_tokens=1024, profile="h100-nvlink")
    _check_placement(s, lengths, 4, 1024)
    sizes = {j.size for j in s.jobs}
    assert sizes == {1, 2, 4}, s.splits()
    assert next(j for j in s.jobs if 0 in j.seqs).size == 4         # 3800 tokens need 4 ranks of 1024
    assert next(j for j in s.jobs if 1 in j.seqs).size >= 2
    # every rank runs its jobs in the one order of the schedule
    for r in range(4):
        mine = s.jobs_of(r)
        assert [s.jobs.index(j) for j in mine] == sorted(s.jobs.index(j) for j in mine)


def test_the_same_inputs_give_the_same_schedule():
    lengths = [5000, 70, 3000, 900, 900, 64, 1200, 33, 2100]
    a = schedule_batch(lengths, 4, SHAPE, budget_tokens=2048, profile="l40-pcie")
    b = schedule_batch(list(lengths), 4, SHAPE, budget_tokens=2048, profile="l40-pcie")
    assert a == b


def test_an_unplaceable_batch_names_the_sequence_and_the_budget():
    with pytest.raises(ScheduleError, match=r"sequence 2 has 5000 tokens: 1250 per rank even on all 4 ranks, over "
                                            r"the budget of 1024 tokens per rank"):
        schedule_batch([10, 20, 5000], 4, SHAPE, budget_tokens=1024)
    with pytest.raises(ScheduleError, match="every length must be >= 1"):
        schedule_batch([10, 0], 4, SHAPE, budget_tokens=1024)
    with pytest.raises(ScheduleError, match="over the budget"):
        static_schedule([10, 3000], 4, SHAPE, ulysses=2, ring=1, budget_tokens=1024)


def test_the_benchmark_counts_meet_the_goals(capsys):
    """benchmarks/dynamic_degree.py without its wall-time part: deterministic counts (a fixed
    seed, the planner's model), against the best static split per metric."""
    from benchmarks.dynamic_degree import main
    assert main(["--no-time"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split()[2:])
    assert last.startswith("dynamic/best-static slowest-rank ") and set(fields) == {"work", "bytes", "predicted",
                                                                                      "time"}
    assert float(fields["work"]) <= 1.05 and float(fields["bytes"]) <= 0.6 and float(fields["predicted"]) <= 0.85, last


# ----------------------------------------------------------------------------- on 4 ranks
@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_scheduled_attention_matches_float64_on_three_degrees(pools):
    """Ranks give different sequences (gathered in one all-gather); the schedule uses groups of
    4, 2 and 1 rank in one step; every job's output and q/k/v gradients equal float64 attention
    of each sequence alone."""
    local = [[190, 12], [40, 33, 20], [95], [7, 60, 18, 9]]
    res = pools(4).run(dist_dynamic.scheduled_attention, timeout=180, local_lengths=local, budget=64)
    assert all(r["jobs"] == res[0]["jobs"] for r in res), "every rank computed the same schedule"
    assert res[0]["meshes"] == 6
    sizes = {size for _, _, size, _, _ in res[0]["jobs"]}
    assert sizes == {1, 2, 4}, res[0]["jobs"]
    ran = sorted(i for r in res for seqs, size, _, _ in r["ran"] if size == 1 for i in seqs)
    shared = {seqs for r in res for seqs, size, _, _ in r["ran"] if size > 1}
    assert sorted(ran + [i for s in shared for i in s]) == list(range(10)), "each sequence ran once"
    for r in res:
        assert r["worst"]["out"] <= 2e-6 and r["worst"]["grad"] <= 2e-5, r["worst"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_refusals_are_the_same_on_every_rank(pools):
    """An unplaceable batch, a bad length on one rank, and ranks given different global batches:
    every rank raises, the same way, before any job runs (none hangs)."""
    res = pools(4).run(dist_dynamic.schedule_error, timeout=60, local_lengths=[[10], [300], [5], [6]], budget=64)
    assert len(set(res)) == 1 and "sequence 1 has 300 tokens" in res[0] and "budget of 64" in res[0], res
    res = pools(4).run(dist_dynamic.schedule_error, timeout=60, local_lengths=[[10], [0], [5], [6]])
    assert all(r and "rank 1" in r and "positive integers" in r for r in res), res
    same, other = [10, 20, 30], [10, 20, 31]
    res = pools(4).run(dist_dynamic.schedule_error, timeout=60, global_lengths=[same, same, other, same])
    assert all(r and "lengths digest" in r for r in res), res
    assert pools(4).run(dist_dynamic.schedule_error, timeout=60, global_lengths=[same] * 4) == [None] * 4


def test_plan_prints_the_gain_for_a_length_distribution(tmp_path, capsys):
    from usp_hal.cli import main
    base = ["plan", "--world", "4", "--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--causal", "--bwd",
            "--profile", "h100-nvlink"]
    assert main(base + ["--seqlen", "131072", "--length-dist", "lognormal:1024:32768", "--budget-tokens",
                        "16384"]) == 0
    out = capsys.readouterr().out
    tail = out.split("split per global batch")[1].splitlines()
    assert "16 batches of lognormal:1024:32768" in tail[0] and "16384 tokens per rank" in tail[0]
    assert tail[-1].strip().startswith("dynamic / best static: predicted 0.8"), tail[-1]
    f = tmp_path / "lengths.txt"
    f.write_text("4000 300 300 100\n2000,2000\n")
    assert main(base + ["--seqlen", "4700", "--lengths", str(f), "--json"]) == 0
    import json
    res = json.loads(capsys.readouterr().out)["dynamic_degree"]
    assert res["budget_tokens"] == 1175 and "dynamic" in res and "U4xR1" in res["static"], res
    for bad, needle in ((["--length-dist", "lognormal:x:1"], "takes numbers"),
                        (["--length-dist", "zipf"], "use one of"),
                        (["--lengths", str(tmp_path / "none.txt")], "No such file"),
                        (["--budget-tokens", "100"], "goes with --length-dist")):
        assert main(base + ["--seqlen", "4096"] + bad) == 2
        assert needle in capsys.readouterr().err, bad


@pytest.mark.multirank
@pytest.mark.models
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrapper", ["plain", "fsdp"])
def test_a_llama_trains_as_one_process_with_three_degrees_in_a_step(pools, wrapper):
    """A custom loop (tests/dist_dynamic.py, 9 lines beyond the plain loop: the DynamicDegree,
    the schedule, the job loop with its context, the global label count, sync_gradients):
    groups of 4, 2 and 1 rank in every step, packed short sequences on single ranks; loss, the
    first step's gradients and the parameters after 3 AdamW steps equal one process on the same
    global batch (fp32).  Under FSDP2 over the whole world the jobs run in the schedule's rounds
    (Schedule.slots: 2 more lines), a rank without a job in a round calling the model on a
    stand-in, so every rank makes FSDP's collectives in the same order."""
    local = [[61, 15], [30, 14, 13], [21], [7, 4, 12, 11]]      # rounds: 4 ranks, 2 + 2, 1 each, 1 on two ranks
    res = pools(4).run(dist_dynamic.scheduled_training, timeout=240, local_lengths=local, budget=16,
                       wrapper=wrapper)
    r0 = res[0]
    assert {s[0] for r in res for s in r["sizes"]} == {1, 2, 4}, [r["sizes"] for r in res]
    assert all(r["losses"] == r0["losses"] for r in res), "every rank holds the global loss"
    if wrapper == "fsdp":
        assert sum(r["standins"] for r in res) > 0, "some round has a rank without a job"
    print(f"loss {r0['loss_diff']:.1e} grad {r0['grad_diff']:.1e} (scale {r0['grad_scale']:.1e}) "
          f"params {r0['param_diff']:.1e}")
    from tests.test_dp_sp import GRAD_TOL, LOSS_TOL, PARAM_TOL  # the dp x sp bounds
    assert r0["loss_diff"] <= LOSS_TOL and r0["grad_diff"] <= GRAD_TOL and r0["grad_scale"] > 1e-2, r0
    assert r0["param_diff"] <= PARAM_TOL, r0
    assert r0["ref_losses"][0] - r0["ref_losses"][-1] > 0.05, r0["ref_losses"]     # the steps train


@pytest.mark.multirank
@pytest.mark.models
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", ["qwen3_next"])
def test_a_hybrid_trains_as_one_process_with_state_passing_on_rings_of_two_sizes(pools, model_type):
    """qwen3_next (gated DeltaNet + its causal conv, recurrence="auto") with rings only
    (ulysses_degrees=(1,)) and no packing on single ranks (pack=False: transformers' torch
    fallback of the rule refuses packed documents without flash-linear-attention): in every
    step its recurrence crosses a ring of 4 and rings of 2 by
    state passing, and runs whole on single ranks; loss, first-step gradients and 3 AdamW steps
    against one process on every sequence, within the bounds of the hybrid tests' state passing
    (tests/test_hybrid_integration.py)."""
    from tests.test_hybrid_integration import TOL
    local = [[61, 15], [30, 14, 13], [21], [7, 4, 12, 11]]
    res = pools(4).run(dist_dynamic.scheduled_training, timeout=240, local_lengths=local, budget=16,
                       model_type=model_type, ulysses_degrees=(1,), pack=False, lr=1e-3)
    r0 = res[0]
    splits = {s for r in res for s in r["sizes"]}
    assert splits == {(4, 1, 4), (2, 1, 2), (1, 1, 1)}, splits
    modes = {m for r in res for m in map(tuple, r["modes"])}       # (ring degree, recurrence) of the jobs run
    assert {m for ring, m in modes if ring > 1} == {"state_passing"}, modes
    print(f"loss {r0['loss_diff']:.1e} grad {r0['grad_diff']:.1e} (scale {r0['grad_scale']:.1e}) "
          f"params {r0['param_diff']:.1e}")
    tol = TOL["state_passing"]
    assert r0["loss_diff"] <= tol["loss"] and r0["grad_diff"] <= tol["grad"] * r0["grad_scale"], r0
    assert r0["param_diff"] <= tol["param"], r0


@pytest.mark.multirank
@pytest.mark.models
@pytest.mark.timeout(120)
@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)])
def test_a_sequence_shorter_than_the_group_is_refused_on_every_rank(pools, U, R):
    """One token on two ranks leaves a rank without a token, which the model's reshapes cannot
    take (on 5edbecd: that rank crashed, the other hung); shard_batch refuses it on every rank,
    naming the shortest sequence the group takes; two tokens run exactly."""
    res = pools(2).run(dist_dynamic.short_sequence, timeout=60, U=U, R=R, S=1)
    assert all("a sequence of 1 tokens leaves a rank" in r["error"] and "at least 2 tokens" in r["error"]
               for r in res), res
    res = pools(2).run(dist_dynamic.short_sequence, timeout=60, U=U, R=R, S=2)
    assert all(r["diff"] <= 1e-5 for r in res), res
