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
    from usp_hal import state_passing as sp
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
