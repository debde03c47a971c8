"""flash-linear-attention 0.6.0's gated DeltaNet and KDA kernels under usp-hal's state passing
(usp_hal.integrations.fla): on 2 (Ring-2, zigzag) and 4 (Ulysses-2 x Ring-2, packed documents)
gloo ranks against the float64 recurrence over the whole sequence, output and every input's
gradient.  fla's plain torch kernels (naive_*) run here; its Triton kernels need a GPU: their
cases skip on the CPU with the error fla raises there, and run as they are on a CUDA machine.
A dropped state must fail, and fla's kernel must have run (counted)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("fla")
pytest.importorskip("triton")   # fla's ops import triton, even its naive kernels' modules

from tests import dist_fla  # noqa: E402
from usp_hal.integrations import fla as usp_fla  # noqa: E402

pytestmark = [pytest.mark.models, pytest.mark.optional_pkg]

CU = (0, 5, 13, 26)
MESHES = {"r2-zigzag": (1, 2, "zigzag", None), "u2r2-documents": (2, 2, "varlen_zigzag", CU)}
KERNELS = {"gdn": ["naive_chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule", "chunk_gated_delta_rule"],
           "kda": ["naive_chunk_kda", "naive_recurrent_kda", "chunk_kda"]}


def _device_for(name: str) -> str:
    """"cpu" for fla's torch kernels; for its Triton ones "cuda", or a skip naming what fla
    raises on this machine's CPU (a one-process probe of the kernel itself)."""
    if name.startswith("naive_"):
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    run = usp_fla.kernel(name)
    B, T, H, d = 1, 8, 1, 16
    g = -torch.rand(B, T, H, d) if name.endswith("kda") else -torch.rand(B, T, H)
    try:
        run(torch.randn(B, T, H, d), torch.randn(B, T, H, d), torch.randn(B, T, H, d), g, torch.rand(B, T, H))
    except Exception as exc:
        pytest.skip(f"fla's Triton kernel {name} does not run on the CPU: {type(exc).__name__}: {exc}")
    return "cpu"


def _within(results):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if not v <= 1.0}
        assert not bad, f"rank {rank}: worst error / tolerance above 1: {bad}"


@pytest.mark.multirank
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("op,kernel", [(op, k) for op, ks in KERNELS.items() for k in ks])
def test_fla_kernel_under_state_passing_matches_float64(pools, op, kernel, mesh):
    device = _device_for(kernel)
    U, R, layout, cu = MESHES[mesh]
    res = pools(U * R).run(dist_fla.fla_case, timeout=180, U=U, R=R, layout=layout, cu=cu, op=op, kernel=kernel,
                           device=device)
    _within(res)
    # fla's kernel ran on every rank's pieces (a first run from [0 | I], a second from the state received)
    assert all(r["kernel_calls"] <= -2 for r in res), [r["kernel_calls"] for r in res]


@pytest.mark.multirank
def test_fla_dropped_state_is_caught(pools):
    res = pools(2).run(dist_fla.fla_case, timeout=180, U=1, R=2, layout="zigzag", kernel="naive_chunk_gated_delta_rule",
                       mutation="drop_state")
    worst = max(max(v for k, v in r.items() if k != "kernel_calls") for r in res)
    assert worst > 10, worst


@pytest.mark.parametrize("kw,needle", [
    ({"cu_seqlens": torch.tensor([0, 4])}, "pass the global document boundaries as cu_seqlens="),
    ({"cp_context": object()}, "fla's own context parallel"),
    ({"state_v_first": True}, "states [B, H, dk, dv]"),
    ({"initial_state": None}, "sets the initial state"),
])
def test_keywords_that_break_state_passing_are_refused(kw, needle):
    with pytest.raises(ValueError, match=r"usp_hal.integrations.fla") as info:
        usp_fla.kernel("naive_chunk_gated_delta_rule", **kw)
    assert needle in str(info.value)
    with pytest.raises(ValueError, match="unknown kernel 'chunk_gla'"):
        usp_fla.kernel("chunk_gla")


def test_fla_naive_kernels_match_usp_hal_reference():
    """fla's torch kernels and usp-hal's float64 recurrence are the same recurrence (with a
    nonzero initial state: the state passing seam), GDN and KDA."""
    from usp_hal.mixers import state_passing as sp
    g = torch.Generator().manual_seed(3)
    B, T, H, dk, dv = 1, 21, 2, 8, 6
    q, v = torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dv, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    beta, s0 = torch.rand(B, T, H, generator=g), torch.randn(B, H, dk, dv, generator=g)
    for op, gate in (("gdn", -torch.rand(B, T, H, generator=g)), ("kda", -torch.rand(B, T, H, dk, generator=g))):
        ours, st = sp.delta_rule_reference(*(t.double() for t in (q, k, v, gate, beta)), initial_state=s0.double())
        for name in KERNELS[op][:2]:
            out, st2 = usp_fla.kernel(name)(q, k, v, gate, beta, initial_state=s0)
            torch.testing.assert_close(out.double(), ours, atol=2e-4, rtol=2e-4, msg=name)
            torch.testing.assert_close(st2.double(), st, atol=2e-4, rtol=2e-4, msg=name)


# ----------------------------------------------------------------------------- agreed kernel and arguments
REFUSALS = {
    # case: what every rank's error must say
    "scale": ["different settings", "rank 0: fla.naive_chunk_gated_delta_rule()",
              "rank 1: fla.naive_chunk_gated_delta_rule(scale=0.2)"],
    "kernel": ["different settings", "fla.naive_chunk_gated_delta_rule()", "fla.naive_recurrent_gated_delta_rule()"],
    "callable": ["different settings", "tests.dist_fla.gva_wrapper()", "tests.dist_fla.other_wrapper()"],
    "chunk_size": ["different settings", "chunk_size=16", "chunk_size=64"],
    "unknown_keyword": ["rank 1", "naive_chunk_gated_delta_rule takes no keyword 'use_foo'", "its keywords:"],
    "unknown_kernel": ["rank 1", "unknown kernel 'chunk_gla'", "naive_chunk_gated_delta_rule"],
    "refused_keyword": ["rank 1", "fla's own context parallel"],
    "triton_on_cpu": ["rank 0", "rank 1", "0 active drivers", "kernel='naive_chunk_gated_delta_rule'"],
    "gva_heads": ["value heads (3) are not a multiple of the q/k heads (2)"],
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(REFUSALS))
def test_rank_different_or_unrunnable_kernel_is_refused_on_every_rank(pools, case):
    """One rank's other ``scale=``, kernel, callable or keyword, or a kernel some rank cannot
    run: every rank raises the same error, naming each rank's setting or the reason, in
    seconds (before any state moves).  Without the kernel in the agreement the ``scale`` case
    ran to an output 538x the tolerance off, and the keyword cases left the other rank in
    CommError."""
    res = pools(2).run(dist_fla.fla_refusal, timeout=120, case=case)
    assert all("error" in r for r in res), res
    assert res[0]["message"] == res[1]["message"] and res[0]["error"] == res[1]["error"], res
    assert all(r["seconds"] < 20 for r in res), res
    text = res[0]["message"]
    assert res[0]["error"].startswith("Agreement"), res[0]       # usp_hal.parallel.comm.AgreementError's kinds
    for needle in REFUSALS[case]:
        assert needle in text, (needle, text)


@pytest.mark.multirank
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("op,kernel", [("gdn", "naive_chunk_gated_delta_rule"),
                                       ("gdn", "naive_recurrent_gated_delta_rule"),
                                       ("kda", "naive_chunk_kda"), ("kda", "naive_recurrent_kda"),
                                       ("gdn", "gva_wrapper")])
def test_fla_gva_heads_match_float64(pools, op, kernel, mesh):
    """GVA as Qwen3-Next's gated DeltaNet has it: 4 value heads over 2 q/k heads (value head j
    reads q/k head j // 2, fla's indexing), against the float64 recurrence, output and every
    input's gradient (q/k's summed over the value heads they serve).  fla's naive GDN kernels
    do not take GVA: usp-hal repeats q/k for them; its naive KDA kernels take it themselves;
    ``gva_wrapper`` is a callable kernel= that repeats q/k itself."""
    U, R, layout, cu = MESHES[mesh]
    res = pools(U * R).run(dist_fla.fla_case, timeout=180, U=U, R=R, layout=layout, cu=cu, op=op, kernel=kernel,
                           H=4, Hk=2)
    _within(res)
    assert all(r["kernel_calls"] <= -2 for r in res), [r["kernel_calls"] for r in res]


def test_gva_is_the_head_mapping_of_fla_kernels():
    """fla's own GVA (its naive KDA kernels take HV > H themselves, as its Triton kernels do)
    equals the float64 reference's mapping (value head j reads q/k head j // (HV/H)), and
    usp-hal's wrapped naive GDN kernels (q/k repeated) give the same; a mapping by j % H
    (q/k tiled instead) would not."""
    from usp_hal.mixers import state_passing as sp
    g = torch.Generator().manual_seed(5)
    B, T, H, HV, dk, dv = 1, 19, 2, 6, 8, 5
    q, v = torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, HV, dv, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    beta, s0 = torch.rand(B, T, HV, generator=g), torch.randn(B, HV, dk, dv, generator=g)
    for op, gate in (("gdn", -torch.rand(B, T, HV, generator=g)), ("kda", -torch.rand(B, T, HV, dk, generator=g))):
        ours, st = sp.delta_rule_reference(*(t.double() for t in (q, k, v, gate, beta)), initial_state=s0.double())
        tiled, _ = sp.delta_rule_reference(*(t.double() for t in (q.repeat(1, 1, HV // H, 1),
                                                                  k.repeat(1, 1, HV // H, 1), v, gate, beta)),
                                           initial_state=s0.double())
        assert (tiled - ours).abs().max() > 1e-2          # the two mappings differ on this problem
        for name in KERNELS[op][:2]:
            out, st2 = usp_fla.kernel(name)(q, k, v, gate, beta, initial_state=s0)
            torch.testing.assert_close(out.double(), ours, atol=2e-4, rtol=2e-4, msg=name)
            torch.testing.assert_close(st2.double(), st, atol=2e-4, rtol=2e-4, msg=name)
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    with pytest.raises(RuntimeError):       # fla's naive GDN kernel itself does not take GVA
        naive_recurrent_gated_delta_rule(q, k, v, beta, gate[..., 0], initial_state=s0)


def test_kernel_takes_a_callable_and_checks_keywords():
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 5, 1, 8, generator=g), torch.randn(1, 5, 1, 8, generator=g),
            torch.randn(1, 5, 1, 8, generator=g), -torch.rand(1, 5, 1, generator=g), torch.rand(1, 5, 1, generator=g))
    by_callable = usp_fla.kernel(naive_chunk_gated_delta_rule, chunk_size=16)(*args)
    by_name = usp_fla.kernel("naive_chunk_gated_delta_rule", chunk_size=16)(*args)
    assert all(torch.equal(a, b) for a, b in zip(by_callable, by_name)) and by_name[1].shape == (1, 1, 8, 8)
    with pytest.raises(ValueError, match="takes no keyword 'chunk'"):
        usp_fla.kernel("naive_chunk_gated_delta_rule", chunk=16)
    with pytest.raises(ValueError, match="takes no keyword 'chunk'"):
        usp_fla.kernel(naive_chunk_gated_delta_rule, chunk=16)


def test_default_triton_kernel_on_cpu_tensors_names_the_naive_one():
    q = torch.randn(1, 8, 1, 16)
    for name, alt in (("chunk_gated_delta_rule", "naive_chunk_gated_delta_rule"), ("chunk_kda", "naive_chunk_kda"),
                      ("fused_recurrent_kda", "naive_recurrent_kda")):
        with pytest.raises(RuntimeError, match=f"pass kernel='{alt}'"):
            usp_fla.kernel(name)(q, q, q, -torch.rand(1, 8, 1), torch.rand(1, 8, 1))
