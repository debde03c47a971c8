"""The Ulysses x Ring degree per global batch: the schedule (one process) and its run on 4 gloo
ranks against float64 attention of each sequence alone."""
import re

import pytest

from tests import dist_dynamic
from usp_hal.planning.schedule import AttentionShape, ScheduleError, group_sizes, schedule_batch, static_schedule
from usp_hal.planning.stepcost import SCALED

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


@pytest.mark.parametrize("bad, needle", [(None, "is None (NoneType)"), (2.7, "is 2.7 (float)"),
                                         (True, "is True (bool)"), ("5", "is '5' (str)"),
                                         (2 ** 63, "over the 2**62 a length may be"), (0, "every length must be >= 1")])
def test_lengths_are_checked_before_any_conversion(bad, needle):
    """2.7 is not scheduled as 2 tokens, None and 2**63 do not fail inside a conversion."""
    with pytest.raises(ScheduleError, match=re.escape(f"sequence 1 {needle}") if needle.startswith("is")
                       else re.escape(needle)):
        schedule_batch([10, bad, 5], 4, SHAPE, budget_tokens=1024)


def test_an_unplaceable_batch_names_the_sequence_and_the_budget():
    with pytest.raises(ScheduleError, match=r"sequence 2 has 5000 tokens: 1250 per rank even on all 4 ranks, over "
                                            r"the budget of 1024 tokens per rank"):
        schedule_batch([10, 20, 5000], 4, SHAPE, budget_tokens=1024)
    with pytest.raises(ScheduleError, match="every length must be >= 1"):
        schedule_batch([10, 0], 4, SHAPE, budget_tokens=1024)
    with pytest.raises(ScheduleError, match="over the budget"):
        static_schedule([10, 3000], 4, SHAPE, ulysses=2, ring=1, budget_tokens=1024)


def test_the_benchmark_predictions_meet_the_goals(capsys):
    """benchmarks/dynamic_degree.py without its measured part: deterministic predictions (fixed
    seeds, the planner's whole-step model) of the Llama-3-8B-shaped step on the GPU profiles:
    never slower than static+ (the best fixed split placed with the same care), the slowest
    rank within 2% of the mean, within 5% of the batch's lower bound."""
    from benchmarks.dynamic_degree import main
    for dist in ("lognormal", "llama3-sft"):
        assert main(["--no-time", "--steps", "8", "--dist", dist]) == 0
        out = capsys.readouterr().out
        last = out.strip().splitlines()[-1]
        assert last.startswith("dynamic/static+ predicted="), last
        fields = dict(kv.split("=") for kv in last.split()[1:])
        assert set(fields) == {"predicted", "measured", "slowest/mean", "schedule/bound", "plan-error", "spearman"}
        assert float(fields["predicted"]) <= 1.0 and float(fields["slowest/mean"]) <= 1.02, last
        assert float(fields["schedule/bound"]) <= 1.05, last
        per_profile = [ln for ln in out.splitlines() if ": dynamic/static+ predicted=" in ln]
        assert [ln.split(":")[0] for ln in per_profile] == ["h100-nvlink", "l40-pcie"], per_profile
        for ln in per_profile:
            got = dict(kv.split("=") for kv in ln.split() if "=" in kv)
            assert float(got["predicted"]) <= 1.0 and float(got["slowest/mean"]) <= 1.02, ln


def test_the_benchmark_replay_prices_a_dump_with_and_without_the_split_shifts(tmp_path, capsys):
    """benchmarks.dynamic_degree --replay on a dump of whole steps of three fixed splits whose
    U2xR2 jobs run at 1.15x their price and U1xR4's at 0.9x (the rest as priced, 1% noise):
    with the per-split shifts the replay's largest error of a schedule is under a third of the
    error without them, and it ranks the three schedules as measured; a dump it cannot read is
    an error, not a line of numbers."""
    import json
    import random

    from benchmarks.dynamic_degree import main
    from usp_hal.planning.schedule import Scheduler, draw_batches
    from usp_hal.planning.stepcost import PARTS
    sched = Scheduler(4, AttentionShape(8, 32, 2, "fp32", True, True, hidden=256, intermediate=896, layers=2,
                                        vocab=2048), budget_tokens=1024, profile="cpu")
    rnd = random.Random(1)
    truth = {"4,2": 0.15, "4,1": -0.1}

    def step(b, u, r):
        raw = sched.static(b, u, r).parts(unscaled=True)
        took = sum(raw[k] for k in PARTS) + raw["constant"] + raw["idle"] + \
            sum(raw.get(k, 0.0) * d for k, d in truth.items())
        return raw, took * rnd.uniform(0.99, 1.01)
    splits = {"static U2xR2": (2, 2), "static U1xR4": (1, 4), "static dp2 x U2xR1": (2, 1)}
    bs = draw_batches("lognormal:1024:32768:1.5", 10, 4 * 2048, seed=2, scale=16)
    cal = [step(b, *ur) for b in bs[:2] for ur in splits.values()]
    steps = []
    for k, b in enumerate(bs[2:]):
        for name, ur in splits.items():
            raw, took = step(b, *ur)
            steps.append({"batch": k, "schedule": name, "alike": [], "parts": raw, "seconds": took,
                          "predicted": 0.0, "repeat": 0})
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"dist": "lognormal", "window": 12, "repeat": 1,
                                "seeds": {"0": {"steps": steps, "calibration": cal}}}))
    assert main(["--replay", str(path)]) == 0
    out = capsys.readouterr().out
    got = {}
    for ln in out.splitlines()[1:]:
        m = re.search(r"spearman ([0-9.]+), plan error ([0-9.]+)%", ln)
        assert m, out
        got["with" if "with the split shifts" in ln else "without"] = (float(m.group(1)), float(m.group(2)))
    assert set(got) == {"with", "without"}, out
    assert got["with"][0] == 1.0 and got["with"][1] < got["without"][1] / 3, got
    assert got["without"][1] > 5.0, got
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a --dump of this benchmark"):
        main(["--replay", str(path)])

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
    model = ["--hidden", "4096", "--intermediate", "14336", "--layers", "32", "--vocab", "128256"]
    assert main(base + model + ["--seqlen", "131072", "--length-dist", "llama3-sft", "--budget-tokens", "16384"]) == 0
    out = capsys.readouterr().out
    tail = out.split("split per global batch")[1].splitlines()
    assert "16 batches of llama3-sft" in tail[0] and "16384 tokens per rank" in tail[0]
    assert "32 layers, hidden 4096" in tail[0], tail[0]        # priced as whole steps
    gain = next(ln for ln in tail if "predicted gain over static+" in ln)
    # the same figure the benchmark's whole-step comparison gives (never above 1: the fixed split runs instead)
    ratio = float(gain.split("dynamic / static+ ")[1].split(")")[0])
    assert 0.9 < ratio <= 1.0, gain
    on = "\n".join(tail[tail.index("  turn it on:"):])
    assert ("USPTrainingArguments(..., usp_dynamic_degree=True, usp_budget_tokens=16384, "
            "usp_profile='h100-nvlink')") in on
    assert "usp.dynamic_degree(model, budget_tokens=16384, profile='h100-nvlink')" in on
    assert "usp_dynamic_trial_steps=3" in on and "trial_steps=3 (custom loop)" in on
    assert "usp_dynamic_refit_steps=32" in on and "refit_steps=32 (custom loop)" in on
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


# ----------------------------------------------------------------------------- every schedule runs
@pytest.mark.multirank
@pytest.mark.models
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world, local, budget", [
    (2, [[1], [2]], 1),                  # 1 token alone, 2 tokens on both ranks
    (4, [[3], [], [], []], 2),           # 3 tokens need 2 ranks of 2; no rank of theirs may be empty
    (4, [[18], [1], [], []], 16),        # 18 tokens on a group, the 1-token sequence on one rank
])
def test_short_sequences_run_in_the_documented_loop_as_one_process(pools, world, local, budget):
    """The fuzzed batches whose schedule once gave a rank of a job no token (the custom loop then
    raised AgreementValueError on two ranks and the others died in sync_gradients): every job
    now gives each of its ranks a token, and the documented loop trains as one process."""
    res = pools(world).run(dist_dynamic.scheduled_training, timeout=300, local_lengths=local, budget=budget, steps=2)
    r0 = res[0]
    from tests.test_dp_sp import GRAD_TOL, LOSS_TOL, PARAM_TOL
    # GRAD_TOL holds for gradients up to 0.1; with a label or two in the batch they reach a few
    # units, so the same relative bound
    grad_tol = GRAD_TOL * max(1.0, r0["grad_scale"] / 0.1)
    assert r0["loss_diff"] <= LOSS_TOL and r0["grad_diff"] <= grad_tol and r0["param_diff"] <= PARAM_TOL, r0


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize("setting, values", [
    ("budget_tokens", [64, 64, 32, 64]),
    ("profile", ["cpu-4ranks", "cpu-4ranks", "cpu-4ranks", "cpu"]),
    ("pack", [True, False, True, True]),
    ("sizes", [(1, 2, 4), (1, 2, 4), (1, 4), (1, 2, 4)]),
    ("ulysses_degrees", [None, None, None, (1,)]),
    ("trial_steps", [0, 0, 2, 0]),
    ("refit_steps", [16, 16, 16, 0]),
])
def test_settings_that_differ_between_ranks_are_refused_on_every_rank(pools, setting, values):
    """A rank built with another budget (one derived from its own free memory, say), profile,
    packing, group sizes or Ulysses degrees: every rank raises at set-up naming the setting, before
    any group is built (ranks once ran different jobs and died in CommError)."""
    res = pools(4).run(dist_dynamic.settings_error, timeout=120, **{setting: values})
    assert all(r and "DynamicDegree: the settings" in r and setting in r for r in res), res
    assert len({r.split(": ", 1)[0] for r in res}) == 1, res


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_global_batch_on_one_rank_only_is_an_agreement_error_on_every_rank(pools):
    """Rank 0 schedules with global_batch=True, the others without: every rank raises the
    agreement's error naming both calls (the two agreements once sent messages of different
    sizes and gloo aborted a process)."""
    res = pools(4).run(dist_dynamic.mixed_global_batch, timeout=120)
    assert all(r and "not at the same agreement" in r and "global batch's lengths" in r and "sequence lengths" in r
               for r in res), res


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("global_batch", [False, True])
@pytest.mark.parametrize("bad, needle", [(None, "None"), (2 ** 63, "2**62"), (2.7, "2.7 (float)"),
                                         (True, "True (bool)"), ("x", "'x' (str)")])
def test_a_bad_length_on_one_rank_is_refused_on_every_rank(pools, bad, needle, global_batch):
    """None and 2**63 once raised on one rank while the others died in CommError; 2.7 was
    scheduled as 2 tokens."""
    res = pools(4).run(dist_dynamic.bad_lengths, timeout=120, bad=bad, global_batch=global_batch)
    assert all(r and "rank 1" in r and needle in r for r in res), res
    assert len(set(res)) == 1, res


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_lengths_beyond_the_first_message_are_gathered(pools):
    """Ranks giving 3, 0, 150 and 61 lengths: the fixed-size first message carries 59, a second
    all-gather the rest; every rank gets every rank's lengths in rank order."""
    counts = [3, 0, 150, 61]
    res = pools(4).run(dist_dynamic.many_lengths, timeout=120, counts=counts)
    want = [1 + (r * 1000 + i) % 50 for r in range(4) for i in range(counts[r])]
    assert all(r["lengths"] == want for r in res)
    assert res[0]["owner"] == [r for r in range(4) for _ in range(counts[r])]
    assert all(r["jobs"] == res[0]["jobs"] for r in res)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_a_schedule_computed_ahead_is_the_same_schedule(pools):
    res = pools(4).run(dist_dynamic.ahead, timeout=120, local_lengths=[[190, 12], [40, 33, 20], [95], [7, 60, 18, 9]])
    assert res == [True] * 4


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_every_rank_computes_the_same_schedules(pools):
    """Random batches scheduled on every rank for worlds of 1, 2, 4 and 8: the same jobs and
    prices everywhere (deterministic, no dependence on a process's hash seed)."""
    import random
    rnd = random.Random(7)
    batches = [[rnd.choice([1, 2, 3, 17, 40, 90, 200, 400]) for _ in range(rnd.randint(1, 12))] for _ in range(12)]
    res = pools(4).run(dist_dynamic.same_schedules, timeout=240, batches=batches, budget=64)
    assert all(r == res[0] for r in res), "ranks computed different schedules"


@pytest.mark.multirank
@pytest.mark.models
@pytest.mark.timeout(300)
def test_a_model_that_cannot_pack_is_not_packed_or_refused_at_set_up(pools):
    """qwen3_next without flash-linear-attention (its gated delta rule's torch kernel refuses
    packed documents; with the default packing one rank once raised inside its forward and the
    others died): usp.dynamic_degree turns packing off for it, and pack=True is refused on every
    rank at set-up, before any data moves."""
    res = pools(4).run(dist_dynamic.hybrid_packing, timeout=240)
    assert all(r == {"pack": False, "packed_jobs": 0} for r in res), res
    res = pools(4).run(dist_dynamic.hybrid_packing, timeout=240, pack=True)
    assert all(r and "cannot pack documents" in r and "Qwen3NextGatedDeltaNet" in r and "pack=False" in r
               for r in res), res


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("slow", ["dynamic", "fixed"])
def test_the_measured_trial_keeps_the_faster_arm_on_every_rank(pools, slow, ahead):
    """trial_steps=2: the first steps run the per-batch schedule and one fixed split in turn (a
    warm-up and two timed steps of each), timed by the gathers the steps make anyway; when the
    per-batch schedule is slower than the model says (a sleep in its jobs), every later step
    runs the fixed split on every rank, and when the fixed split is the slow one the per-batch
    schedule stays.  Without the trial the
    per-batch schedule runs every step (margin 0), slow or not."""
    res = pools(4).run(dist_dynamic.measured_trial, timeout=240, slow=slow, ahead=ahead)
    assert all(r == res[0] for r in res), res
    got = res[0]
    assert got["decided"] == ("fixed" if slow == "dynamic" else "schedule"), got
    assert (got["ratio"] > 1.0) == (slow == "dynamic"), got
    first = got["labels"][:6]
    assert first.count("dynamic") == 3 and len(set(first)) == 2, got       # the trial: three steps of each arm
    fixed = next(lab for lab in first if lab != "dynamic")
    assert got["labels"][-3:] == [fixed if slow == "dynamic" else "dynamic"] * 3, got


def test_the_measured_trial_is_a_pure_function_of_the_lengths_and_the_times():
    """Two trials fed the same batches and times choose alike; a time counts only from the step
    index given with it (a schedule computed ahead sees what every rank sees); the fixed split
    is frozen at its first step and a batch it cannot hold runs the per-batch schedule."""
    from usp_hal.planning.schedule import Scheduler
    from usp_hal.planning.trial import MeasuredTrial
    batches = [[1500 + 10 * k, 900, 700, 300, 200, 100, 90, 80] for k in range(9)] + [[3]]

    def run(times):
        t = MeasuredTrial(Scheduler(4, SHAPE, budget_tokens=1024, profile="h100-nvlink", margin=0.0), trial=2)
        labels = []
        for step, b in enumerate(batches):
            serial, s = t.choose(b, at=step)
            labels.append(s.label)
            t.record(serial, times(s), at=step + 1)
        return t, labels

    slow_dyn, labels = run(lambda s: 2.0 if s.label == "dynamic" else 1.0)
    again, labels2 = run(lambda s: 2.0 if s.label == "dynamic" else 1.0)
    assert labels == labels2 and slow_dyn.samples == again.samples
    fixed = slow_dyn.split and labels[1]
    assert labels[:6] == ["dynamic", fixed] * 3, labels
    assert slow_dyn.decided == "fixed" and slow_dyn.ratio > 1
    assert labels[6:9] == [fixed] * 3, labels
    # the split each batch places at the lowest price (the quick estimate ranked dp2 x U1xR2 first,
    # at about half its placed price)
    assert slow_dyn.split == (4, 1), slow_dyn.split
    assert labels[9] == "dynamic", "3 tokens alone cannot hold the frozen split's 4 ranks: the schedule runs"
    slow_fixed, labels = run(lambda s: 1.0 if s.label == "dynamic" else 2.0)
    assert slow_fixed.decided == "schedule" and labels[6:] == ["dynamic"] * 4, labels
    from usp_hal.planning.trial import PATIENCE
    # every batch's schedule is the fixed split's placement: nothing to compare, the trial ends
    same = MeasuredTrial(Scheduler(4, SHAPE, budget_tokens=1024, profile="h100-nvlink"), trial=1)
    got = set()
    for step in range(PATIENCE * 4 + 1):
        serial, s = same.choose([500, 500, 500, 500], at=step)
        got.add(s.label)
        same.record(serial, 1.0, at=step + 1)
    assert got == {"dp4 x one rank"}, got
    assert same.decided == "schedule" and same.ratio is None and same.samples["schedule"] == []
    late = MeasuredTrial(slow_dyn.scheduler, trial=2)
    serial, _ = late.choose(batches[0], at=0)
    late.record(serial, 1.0, at=3)
    late.choose(batches[1], at=2)
    assert late.samples["schedule"] == [], "a time given for step 3 does not count at step 2"
    late.choose(batches[2], at=3)
    assert len(late.samples["schedule"]) == 1
    with pytest.raises(ValueError, match="trial"):
        MeasuredTrial(slow_dyn.scheduler, trial=0)


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ahead", [False, True])
def test_the_price_is_refitted_to_the_runs_own_steps_alike_on_every_rank(pools, ahead):
    """refit_steps=4: each step's time (the slowest rank's, brought by the next gather) refits
    the whole-step factors; on a machine far slower than the profile prices (a sleep in every
    job) the factors rise from 1 after the first timed step, every rank holds the same factors
    and schedules at every step (also with the schedule computed ahead, which sees a step's time
    only from the gather after it), and the window keeps the last 4 steps, each at least the
    sleep; with calibrate_steps first, the window starts from its steps."""
    res = pools(4).run(dist_dynamic.refitted, timeout=240, ahead=ahead)
    assert all(r == res[0] for r in res), res
    got = res[0]
    assert got["factors"][0] == {k: 1.0 for k in got["factors"][0]}, got["factors"][0]    # nothing timed yet
    assert all(got["factors"][-1][k] > 1.5 for k in SCALED), got["factors"][-1]
    assert len(got["window"]) == 4 and all(t >= 0.05 for _, t in got["window"]), got["window"]
    res = pools(4).run(dist_dynamic.refitted, timeout=240, steps=3, window=8, calibrate=True)
    assert all(r == res[0] for r in res), res
    got = res[0]
    assert got["calibration"] >= 2 and len(got["window"]) == got["calibration"] + 1, got
    assert got["factors"][0] == got["first"], "the first step after calibrate_steps is priced by its factors"


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_whole_step_calibration_runs_every_schedule_and_fits_alike_on_every_rank(pools):
    """DynamicDegree.calibrate_steps: each batch run under the per-batch schedule, its unpacked
    form and every fixed split that holds it, each step timed as the slowest rank's, after the
    first batch's schedules ran once untimed (the warm-up); every rank fits the same factors
    and prices with them from then on."""
    batches = [[200, 9, 12, 7, 30, 5], [150, 40, 22, 64]]
    res = pools(4).run(dist_dynamic.calibrated_steps, timeout=240, batches=batches)
    assert all(r["scale"] == res[0]["scale"] and r["ran"] == res[0]["ran"] for r in res), res
    got = res[0]
    assert got["held"] == got["scale"]
    assert any(abs(v - 1.0) > 1e-6 for v in got["scale"].values()), got["scale"]
    first = [(lab, n) for lens, lab, n in got["ran"] if lens == batches[0]]
    half = len(first) // 2
    assert first[:half] == first[half:] and got["ran"][:half] == got["ran"][half:2 * half], got["ran"]  # warm-up
    for b in batches:
        mine = [(lab, n) for lens, lab, n in got["ran"] if lens == b][-half if b == batches[0] else 0:]
        assert mine[0][0] == mine[1][0] == "dynamic" and mine[1][1] == len(b), mine   # unpacked: a job each
        assert len(mine) >= 3 and all(lab != "dynamic" for lab, _ in mine[2:]), mine


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_whole_step_calibration_on_different_batches_is_refused_on_every_rank(pools):
    """A rank given other calibration batches (or a bad length) would run other schedules, and
    the ranks would wait on each other: every rank raises the same error before any step."""
    same = [[200, 9, 12], [150, 40]]
    res = pools(4).run(dist_dynamic.calibrated_steps_error, timeout=120,
                       batches=[same, same, [[200, 9, 13], [150, 40]], same])
    assert all(r and "calibrate_steps: the batches" in r and "lengths digest" in r for r in res), res
    assert len(set(res)) == 1, res
    res = pools(4).run(dist_dynamic.calibrated_steps_error, timeout=120, batches=[same, [[2.5]], same, same])
    assert all(r and "rank 1" in r and "2.5" in r for r in res), res
    res = pools(4).run(dist_dynamic.calibrated_steps_error, timeout=120, batches=[same] * 4,
                       warmup=[True, True, True, False])
    assert all(r and "calibrate_steps: the batches" in r and "warmup" in r for r in res), res
    assert len(set(res)) == 1, res


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_the_model_paths_own_cost_is_measured_on_every_split_alike(pools):
    """usp.calibrate_calls on 4 ranks: the same result on every rank (a fit of the slowest
    rank's times), a part per call, per token and per document for every split and one
    attention factor within its range, held by the price model; no gradient and no pending
    partial-gradient mark left behind (an optimizer step right after it runs); a single job
    size (the budget caps both), or sizes that differ between ranks, are refused on every rank
    before any job runs."""
    res = pools(4).run(dist_dynamic.calibrated_calls, timeout=180)
    assert all(r["out"] == res[0]["out"] for r in res), res
    got = res[0]
    assert sorted(k for k in got["out"] if k != "attention") == got["splits"] and len(got["splits"]) == 6, got
    assert 0.2 <= got["out"]["attention"] <= 5.0
    assert all(len(v) == 3 and v[2] >= 0 for k, v in got["out"].items() if k != "attention"), got
    assert got["held"].keys() == got["out"].keys() and got["grads"] == 0, got
    assert all(got["held"][k] == pytest.approx(v) for k, v in got["out"].items()), got
    res = pools(4).run(dist_dynamic.calibrated_calls, timeout=60, tokens=(64, 128), error=True)
    assert all(r and "two sizes or more" in r and "budget, 64" in r for r in res) and len(set(res)) == 1, res
    # one rank with other sizes would run other jobs: refused on every rank before any job
    res = pools(4).run(dist_dynamic.calibrated_calls, timeout=60, error=True, rank_tokens={2: (8, 32)})
    assert all(r and "calibrate_calls: the jobs" in r and "sizes digest" in r for r in res), res
    assert len(set(res)) == 1, res
