"""The whole-step price of a job (usp_hal.planning.stepcost): its tables against the planner's direct
prediction, packed documents priced as the kernel runs them, the token-proportional layers."""
import math

import numpy as np
import pytest

from usp_hal.planning.planner import Candidate, PlanError, Problem, load_profile, predict
from usp_hal.planning.stepcost import PARTS, AttentionShape, StepModel, least_tokens

ATT = AttentionShape(32, 128, 8, "bf16", True, True)
LLAMA8B = AttentionShape(32, 128, 8, "bf16", True, True, hidden=4096, intermediate=14336, layers=32, vocab=128256)


@pytest.mark.parametrize("profile", ["h100-nvlink", "l40-pcie"])
def test_the_tables_give_the_planners_prediction(profile):
    """One sequence alone: the interpolated table within 1.5% of predict() at lengths between the
    grid's points (the rest is the planner's own rounding of shards to whole tokens)."""
    m = StepModel(ATT, profile)
    worst = 0.0
    for g, u, lay in [(1, 1, "basic"), (2, 1, "zigzag"), (4, 2, "zigzag"), (4, 4, "basic"), (8, 2, "zigzag")]:
        ns = np.unique(np.geomspace(g, 40000, 25).astype(int))
        got = m.alone(ns, g, u, lay)["time"]
        for n, t in zip(ns, got):
            p = predict(Problem(g, 32, int(n), 128, 8, 1, "bf16", True, True), Candidate(u, g // u, lay), m.profile)
            worst = max(worst, abs(t / p.time - 1))
    assert worst < 0.015, worst


def test_packed_documents_on_one_rank_are_the_sum_of_the_documents():
    """Packed documents share no keys: on one rank no merge between them, each document's kernel
    work, one call's fixed costs, and with a varlen kernel (FA3 on h100-nvlink) one launch per
    pass: the price is the documents' alone minus what the pack pays once."""
    m = StepModel(LLAMA8B, "h100-nvlink")
    assert m.varlen
    docs = (900, 40, 3000, 7)
    packed = m.job(docs, 1, 1, "basic")
    exact = m.job_exact(docs, 1, 1, "basic")
    assert math.isclose(packed.time, exact.time, rel_tol=1e-3), (packed, exact)
    alone = sum(m.job((n,), 1, 1, "basic").time for n in docs)
    tab = m.table(1, 1, "basic")
    once = m.layers * (tab.fixed + 2 * tab.launch) + m.call_overhead()   # fixed costs and the launches per pass
    assert math.isclose(packed.time, alone - (len(docs) - 1) * once, rel_tol=1e-6), (packed.time, alone, once)
    # the planner itself: no merges (or gradient accumulation) between packed documents
    cu = (0, 900, 940, 3940, 3947)
    p = predict(Problem(1, 32, 3947, 128, 8, 1, "bf16", True, True, cu), Candidate(1, 1, "basic"), m.profile)
    assert p.detail["merges"] == 0.0


def test_a_kernel_without_varlen_launches_each_document():
    """SDPA (the CPU profile) has no varlen entry: a packed one-rank call launches per document."""
    shape = AttentionShape(8, 32, 2, "fp32", True, True, hidden=256, intermediate=896, layers=2, vocab=2048)
    m = StepModel(shape, "cpu-4ranks")
    assert not m.varlen
    p4 = predict(Problem(1, 8, 400, 32, 2, 1, "fp32", True, True, (0, 100, 200, 300, 400)), Candidate(1, 1, "basic"),
                 m.profile)
    assert p4.detail["mean_calls"] == 8        # 4 documents x forward and backward


@pytest.mark.parametrize("g, u", [(2, 1), (4, 2), (2, 2), (4, 1)])
def test_packed_ring_jobs_from_their_documents_are_close_to_the_direct_prediction(g, u):
    """Several documents on a group: summed from each document's table entry (varlen_zigzag cuts
    every document for the ring), the all-to-alls and ring messages at the total length; within
    8% of one direct prediction of the packed call."""
    m = StepModel(ATT, "h100-nvlink")
    lay = "varlen_zigzag" if g // u > 1 else "basic"
    for docs in [(1000, 200, 3000), (100,) * 10, (5000, 2000), (3, 40, 7000, 1), (16000, 300)]:
        a, e = m.job(docs, g, u, lay), m.job_exact(docs, g, u, lay)
        assert abs(a.time / e.time - 1) < 0.08, (docs, a.time, e.time)


def test_token_layers_and_the_step_constant():
    m = StepModel(LLAMA8B, "h100-nvlink")
    # Llama-3-8B: about 6.98e9 parameters plus 2 x 0.53e9 for the embedding and head
    assert 7.9e9 < LLAMA8B.parameters() < 8.1e9
    lin = load_profile("h100-nvlink")["linear"]["bf16"]["flops"]
    per_token = float(m.tokens_time(1))
    gemm = 3 * LLAMA8B.gemm_flops_per_token() / lin
    assert gemm < per_token < 1.3 * gemm          # GEMMs dominate; the elementwise traffic adds a part
    assert float(m.tokens_time(1000)) == pytest.approx(1000 * per_token)
    # a job of one sequence: its parts sum to its time, the tokens' share what the layers cost
    c = m.job((4096,), 2, 2, "basic")
    assert c.time == pytest.approx(sum(c.parts().values()))
    assert c.tokens == pytest.approx(float(m.tokens_time(2048)))
    assert m.step_constant(4) > 0 and m.step_constant(1) < m.step_constant(4)


def test_shape_from_a_transformers_config():
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    assert AttentionShape.from_config(cfg) == LLAMA8B
    from transformers import Qwen3MoeConfig
    moe = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts_per_tok=8, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=1000)
    s = AttentionShape.from_config(moe, dtype="float32")
    assert (s.intermediate, s.head_dim, s.kv_heads, s.dtype) == (768 * 8, 128, 4, "fp32")


def test_a_profile_without_what_the_step_needs_is_refused_naming_what_to_do():
    with pytest.raises(PlanError, match=r"no attention kernel rate for fp32 .* calibrate"):
        StepModel(AttentionShape(8, 64, dtype="fp32", hidden=512, intermediate=1024, vocab=100), "h100-nvlink")
    prof = dict(load_profile("h100-nvlink"))
    prof.pop("linear")
    with pytest.raises(PlanError, match=r"no linear-layer rate for bf16, .*usp-hal calibrate"):
        StepModel(LLAMA8B, prof)
    StepModel(ATT, prof)          # attention alone needs no linear rate


def test_least_tokens_gives_every_rank_one():
    from usp_hal.sequence.positions import local_lengths
    for g, u, lay in [(2, 1, "zigzag"), (4, 2, "zigzag"), (4, 4, "basic"), (8, 1, "zigzag")]:
        n = least_tokens(g, u, lay)
        assert min(min(r) for r in local_lengths(lay, n, g // u, u)) >= 1
        assert min(min(r) for r in local_lengths(lay, n - 1, g // u, u)) == 0


def test_a_whole_step_fit_recovers_the_factors_and_holds_an_unexercised_part():
    """Steps made of known parts, timed as those parts times known factors (noise-free): the fit
    gives back the common factor and the per-call overhead's own (near: each is held towards 1);
    with no overhead in any step, that factor stays 1; bad times are refused; the factors change
    every price the model gives after set_part_scale."""
    import random

    from usp_hal.planning.stepcost import SCALED, fit_part_scale
    rnd = random.Random(3)

    def steps(common, overhead):
        truth = {k: common for k in SCALED}
        truth["overhead"] = overhead
        out = []
        for _ in range(40):
            parts = {"attention": rnd.uniform(0.1, 1.0), "tokens": rnd.uniform(0.5, 3.0),
                     "communication": rnd.uniform(0.0, 0.2), "overhead": rnd.uniform(0.0, 0.6) if overhead else 0.0,
                     "idle": rnd.uniform(0.0, 0.2), "constant": 0.3}
            out.append((parts, sum(truth[k] * parts[k] for k in SCALED) + parts["idle"]))
        return out
    got = fit_part_scale(steps(0.8, 0.5))
    assert all(got[k] == pytest.approx(0.8, rel=0.02) for k in SCALED if k != "overhead"), got
    assert got["overhead"] == pytest.approx(0.5, rel=0.1), got      # within 10%: the prior pulls it towards 1
    got = fit_part_scale(steps(1.3, 0.0))
    assert got["tokens"] == pytest.approx(1.3, rel=0.02) and got["overhead"] == pytest.approx(1.0), got
    with pytest.raises(ValueError, match="measured step"):
        fit_part_scale([(steps(1, 1)[0][0], 0.0)])
    shape = AttentionShape(heads=8, head_dim=32, kv_heads=2, dtype="fp32", causal=True, bwd=True, hidden=256,
                           intermediate=896, layers=2, vocab=2048)
    m = StepModel(shape, "cpu")
    before = m.job((300,), 2, 1, "varlen_zigzag")
    const = m.step_constant(4)
    m.set_part_scale({"tokens": 2.0, "constant": 3.0})
    after = m.job((300,), 2, 1, "varlen_zigzag")
    assert after.tokens == pytest.approx(2 * before.tokens) and after.attention == pytest.approx(before.attention)
    assert after.time == pytest.approx(before.time + before.tokens)
    assert m.step_constant(4) == pytest.approx(3 * const)
    with pytest.raises(ValueError, match="unknown parts"):
        m.set_part_scale({"kernel": 2.0})


CPU_MODEL = AttentionShape(heads=8, head_dim=32, kv_heads=2, dtype="fp32", causal=True, bwd=True, hidden=256,
                           intermediate=896, layers=2, vocab=2048)


def test_the_call_fit_recovers_the_attention_factor_and_each_splits_parts():
    """Jobs priced by the cpu profile, "measured" as that price with the attention at 0.75x
    and known parts per call, per token and per packed document on each split (noise-free):
    fit_call_extra gives those back, and the model then prices jobs it never saw (64, 512 and
    768 tokens per rank, documents of 100 tokens) as measured; a split with one size, or a
    time that is not a number, is refused."""
    from usp_hal.planning.stepcost import fit_call_extra
    m = StepModel(CPU_MODEL, "cpu")
    truth = {(1, 1, 1): (0.004, -40e-6, 1e-3), (2, 1, 2): (-0.012, 15e-6, 0.4e-3), (4, 2, 2): (0.02, -5e-6, 0.0),
             (4, 4, 1): (0.009, 30e-6, 2e-3)}
    alpha = 0.75

    def measured(split, lengths):
        g, u, _ = split
        c = m.job(lengths, g, u, "varlen_zigzag" if g > u else "basic")
        f, p, d = truth[split]
        return c, c.time + f + p * (sum(lengths) // g) + (alpha - 1) * c.attention + d * (len(lengths) - 1)
    samples = []
    for split in truth:
        g = split[0]
        for n in (16, 256, 1024):
            samples.append((split, n, 1, *measured(split, (n * g,))))
        docs = tuple([32] * (1024 * g // 32))
        samples.append((split, 1024, len(docs), *measured(split, docs)))
    got = fit_call_extra(samples)
    assert got["attention"] == pytest.approx(alpha, rel=1e-6)
    for (g, u, r), want in truth.items():
        assert got[f"{g},{u},{r}"] == pytest.approx(list(want), rel=1e-4, abs=1e-9), (g, u, r)
    unseen = [(s, lengths, measured(s, lengths)[1]) for s in truth
              for lengths in [(64 * s[0],), (512 * s[0],), (768 * s[0],), (100,) * (8 * s[0])]]
    m.set_call_extra(got)
    for (g, u, r), lengths, took in unseen:
        lay = "varlen_zigzag" if g > u else "basic"
        assert m.job(lengths, g, u, lay).time == pytest.approx(took, rel=1e-6), ((g, u, r), lengths)
    with pytest.raises(ValueError, match="two sizes or more"):
        fit_call_extra([s for s in samples if not (s[0] == (2, 1, 2) and s[2] == 1 and s[1] < 1024)])
    with pytest.raises(ValueError, match="measured job"):
        fit_call_extra([(s[0], s[1], s[2], s[3], float("nan")) if k == 0 else s for k, s in enumerate(samples)])


def test_the_call_attention_factor_scales_every_priced_attention():
    """set_call_extra({"attention": a}) scales the attention of a job alone, a packed job, the
    direct prediction and a one-rank job's fixed part by a (the other parts unchanged), and a
    factor that is not a positive number is refused."""
    from usp_hal.planning.schedule import Scheduler
    m = StepModel(CPU_MODEL, "cpu")
    jobs = [((700,), 2, 1, "varlen_zigzag"), ((90, 300, 41), 4, 2, "varlen_zigzag"), ((500,), 1, 1, "basic")]
    before = [m.job(*j) for j in jobs] + [m.job_exact(*jobs[1])]
    fixed = Scheduler(4, CPU_MODEL, budget_tokens=1024, profile="cpu", model=m)._one_rank_fixed()
    m.set_call_extra({"attention": 0.5})
    after = [m.job(*j) for j in jobs] + [m.job_exact(*jobs[1])]
    for b, a in zip(before, after):
        assert b.attention > 0 and a.attention == pytest.approx(0.5 * b.attention)
        assert (a.tokens, a.communication, a.overhead) == pytest.approx((b.tokens, b.communication, b.overhead))
        assert a.time == pytest.approx(b.time - 0.5 * b.attention)
    fixed_after = Scheduler(4, CPU_MODEL, budget_tokens=1024, profile="cpu", model=m)._one_rank_fixed()
    assert fixed_after <= fixed
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="attention must be a positive number"):
            m.set_call_extra({"attention": bad})


def test_every_part_is_its_factor_times_its_unscaled_price():
    """With the model path's own parts set (a part per token among them), each whole-step factor
    scales its part and nothing else: for a job alone, a packed job and the direct prediction,
    and for a schedule, whose parts(unscaled=True) give back the parts of the same schedule
    priced with every factor 1 (what a refit of the factors is fitted to)."""
    from usp_hal.planning.schedule import Scheduler
    from usp_hal.planning.stepcost import SCALED
    m = StepModel(CPU_MODEL, "cpu")
    m.set_call_extra({"attention": 0.9, "2,1,2": [0.01, 80e-6, 1e-3], "4,2,2": [0.02, -30e-6, 0.0],
                      "1,1,1": [0.003, 40e-6, 1e-3]})
    jobs = [((700,), 2, 1, "varlen_zigzag"), ((90, 300, 41), 4, 2, "varlen_zigzag"), ((500,), 1, 1, "basic")]
    before = [m.job(*j) for j in jobs] + [m.job_exact(*jobs[1])]
    sched = Scheduler(4, CPU_MODEL, budget_tokens=512, profile="cpu", model=m)
    batch = [700, 300, 90, 41, 500, 260, 33]
    plain = sched.static(batch, 4, 1)        # one group of the world: the same jobs at any price
    scale = {"attention": 1.7, "tokens": 0.6, "communication": 2.5, "overhead": 0.4, "constant": 1.3}
    m.set_part_scale(scale)
    after = [m.job(*j) for j in jobs] + [m.job_exact(*jobs[1])]
    for b, a in zip(before, after):
        for k in ("attention", "tokens", "communication", "overhead"):
            assert getattr(a, k) == pytest.approx(scale[k] * getattr(b, k), rel=1e-9), k
    scaled = sched.static(batch, 4, 1)
    assert [(j.seqs, j.first) for j in scaled.jobs] == [(j.seqs, j.first) for j in plain.jobs]
    assert scaled.scale == tuple(scale[k] for k in SCALED) and scaled.predicted != plain.predicted
    got, want = scaled.parts(unscaled=True), plain.parts()
    assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-9), (got, want)
    assert plain.parts(unscaled=True) == {**plain.parts(), "4,4": sum(plain.parts()[k] for k in PARTS)}


def test_a_split_priced_wrong_gets_a_shift_of_its_own():
    """Whole steps of three fixed splits timed as their parts would run if jobs on U2xR2 (4,2)
    took 1.15x their price and jobs on U1xR4 (4,1) 0.95x, the rest as priced (0.5% noise): with
    the shifts held as weakly as the factors the fit prices each split's jobs at 1.15, 0.95 and
    1.0 per second of their price (the common factor plus the split's shift), as held by
    default a little nearer 1, and holds the factors near 1; set on the model, a job on
    (4,2) pays each part at its factor plus the shift and a job on another split does not; a
    schedule priced so gives back, by parts(unscaled=True), the same schedule priced with no
    factor, its breakdown by split summing to the four job parts; a shift that is not a number
    is refused."""
    import random

    from usp_hal.planning.schedule import Scheduler, draw_batches
    from usp_hal.planning.stepcost import PRIOR, SCALED, fit_part_scale
    m = StepModel(CPU_MODEL, "cpu")
    sched = Scheduler(4, CPU_MODEL, budget_tokens=1024, profile="cpu", model=m)
    truth = {"4,2": 0.15, "4,1": -0.05}
    rnd = random.Random(7)
    samples = []
    for b in draw_batches("lognormal:1024:32768:1.5", 6, 4 * 2048, seed=4, scale=16):
        for u, r in ((2, 2), (1, 4), (2, 1)):
            raw = sched.static(b, u, r).parts(unscaled=True)
            took = sum(raw[k] for k in PARTS) + raw["constant"] + raw["idle"] + \
                sum(raw.get(k, 0.0) * d for k, d in truth.items())
            samples.append((raw, took * rnd.uniform(0.995, 1.005)))
    # held as weakly as the factors: what a job of each split pays per second of its price, the
    # common factor plus its shift (the factor and the shifts share what every split pays
    # alike: the prior divides it between them)
    loose = fit_part_scale(samples, shift_prior=PRIOR)
    paid = {k: loose["tokens"] + loose[k] for k in ("4,2", "4,1", "2,2")}
    assert paid == pytest.approx({"4,2": 1.15, "4,1": 0.95, "2,2": 1.0}, abs=0.01), loose
    # as held by default (SHIFT_PRIOR: 6 steps of each split carry a shift most of the way)
    got = fit_part_scale(samples)
    paid = {k: got["tokens"] + got[k] for k in ("4,2", "4,1", "2,2")}
    assert 1.1 < paid["4,2"] < 1.15 and 0.95 < paid["4,1"] < 0.98 and paid["2,2"] == pytest.approx(1.0, abs=0.01), got
    assert all(got[k] == pytest.approx(1.0, abs=0.05) for k in SCALED), got
    assert got == fit_part_scale(list(samples))
    plain = StepModel(CPU_MODEL, "cpu")
    m.set_part_scale(got)
    assert m.split_shift == {(4, 2): got["4,2"], (4, 1): got["4,1"], (2, 2): got["2,2"]}
    for g, u, lay, lens in ((4, 2, "varlen_zigzag", (900, 77)), (4, 2, "zigzag", (1500,)), (1, 1, "basic", (300,))):
        a, b = m.job(lens, g, u, lay), plain.job(lens, g, u, lay)
        d = got.get(f"{g},{u}", 0.0)
        for k in PARTS:
            assert getattr(a, k) == pytest.approx((got[k] + d) * getattr(b, k), rel=1e-9), (g, u, k)
    batch = [700, 300, 90, 41, 500, 260, 33]
    before = Scheduler(4, CPU_MODEL, budget_tokens=512, profile="cpu", model=plain).static(batch, 2, 2)
    after = Scheduler(4, CPU_MODEL, budget_tokens=512, profile="cpu", model=m).static(batch, 2, 2)
    assert [(j.seqs, j.first) for j in after.jobs] == [(j.seqs, j.first) for j in before.jobs]
    assert after.shift and after.predicted != before.predicted
    un = after.parts(unscaled=True)
    assert un == pytest.approx(before.parts(unscaled=True), rel=1e-9), (un, before.parts(unscaled=True))
    assert un["4,2"] == pytest.approx(sum(un[k] for k in PARTS), rel=1e-12)
    with pytest.raises(ValueError, match="split 4,2"):
        m.set_part_scale({"4,2": float("nan")})


def test_the_refit_follows_the_recent_steps_and_forgets_older_ones():
    """StepRefit: steps measured at 1.5x their price move the factors to about 1.5 once they
    fill the window, whatever the calibration's samples said (steps at 0.8x), and the model
    prices with the refitted factors; two refits fed the same steps hold the same factors; a
    window below 1 or a time that is not a positive number is refused."""
    import random

    from usp_hal.planning.stepcost import StepRefit
    rnd = random.Random(5)

    def step(f):
        parts = {"attention": rnd.uniform(0.1, 1.0), "tokens": rnd.uniform(0.5, 3.0),
                 "communication": rnd.uniform(0.0, 0.2), "overhead": rnd.uniform(0.2, 1.0), "idle": 0.0,
                 "constant": 0.3}
        return parts, f * sum(v for k, v in parts.items() if k != "idle")
    cal = [step(0.8) for _ in range(10)]
    later = [step(1.5) for _ in range(12)]
    runs = []
    for _ in range(2):
        m = StepModel(CPU_MODEL, "cpu")
        before = m.job((700,), 2, 1, "varlen_zigzag").tokens
        r = StepRefit(m, 8, cal)
        first = r.record(*later[0])
        assert first["tokens"] < 1.0, first          # mostly the calibration's steps yet
        for s in later[1:]:
            got = r.record(*s)
        assert len(r.samples) == 8
        assert got["tokens"] == pytest.approx(1.5, rel=0.03) and got["overhead"] == pytest.approx(1.5, rel=0.1)
        assert m.part_scale == got
        assert m.job((700,), 2, 1, "varlen_zigzag").tokens == pytest.approx(got["tokens"] * before)
        runs.append(got)
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="window"):
        StepRefit(m, 0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="measured step"):
            r.record(later[0][0], bad)
