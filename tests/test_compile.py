"""torch.compile: a block qkv -> LongContextAttention -> out compiles with fullgraph=True
and zero graph breaks (torch._dynamo.explain), on 2 gloo ranks; compiled outputs and
gradients equal eager ones."""
import pytest

from tests import dist_compile

pytestmark = [pytest.mark.multirank, pytest.mark.compile]


def _check(res):
    for r in res:
        assert r["breaks"] == 0 and r["graphs"] == 1, r
        bad = {k: v for k, v in r["errs"].items() if not v <= 1.0}
        assert not bad, r


@pytest.mark.timeout(600)
@pytest.mark.parametrize("U,R,layout", [(2, 1, "basic"), (1, 2, "zigzag")])
@pytest.mark.parametrize("packed", [False, True], ids=["qkv", "packed"])
def test_compile_fullgraph_zero_breaks(pools, U, R, layout, packed):
    _check(pools(2).run(dist_compile.compile_case, timeout=300, U=U, R=R, layout=layout, packed=packed))


@pytest.mark.timeout(600)
def test_compile_async_module(pools):
    _check(pools(2).run(dist_compile.compile_case, timeout=300, U=2, R=1, module="async"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("U,R,head_major", [(2, 1, False), (1, 2, True)], ids=["u2", "r2-head-major"])
def test_compile_inductor(pools, U, R, head_major):
    """Inductor checks each custom op's outputs against the strides its fake kernel gave:
    inputs in transformers' [B, H, S, D] memory (seen as [B, S, H, D]) once failed there in
    the backward (the fake gradients took q's strides, the real ones were contiguous)."""
    _check(pools(2).run(dist_compile.compile_case, timeout=600, U=U, R=R, backend="inductor",
                        head_major=head_major))


def test_compile_with_cu_seqlens_is_refused_under_fullgraph(pools):
    for r in pools(2).run(dist_compile.compile_cu_seqlens_refused, timeout=120):
        assert "cu_seqlens under torch.compile" in r["msg"], r["msg"][-2000:]
        assert r["fallback_err"] == 0.0, r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)], ids=["u2", "r2"])
def test_compiled_lse_gradient_is_refused_as_in_eager_on_every_rank(pools, U, R, backend):
    """A loss that uses the lse returned by return_lse=True: eager refuses its gradient (the
    backward carries the output's only); compiled, it was dropped silently (dq/dk off).  Now
    every rank raises eager's error, and with the lse unused or detached the compiled output,
    lse and gradients equal float64 attention's."""
    res = pools(2).run(dist_compile.compile_lse_gradient_case, timeout=600, U=U, R=R, backend=backend)
    for r in res:
        assert r["lse"] is not None and "lse.detach()" in r["lse"] and "sinks=" in r["lse"], r
        assert r["lse"].startswith(("RuntimeError", "AgreementRuntimeError")), r["lse"]
        for use in ("detached", "unused"):
            assert r[use] is None, r
            bad = {k: v for k, v in r[f"{use}_errs"].items() if not v <= 1.0}
            assert not bad, (use, r)
    assert res[0]["lse"] == res[1]["lse"]          # the same error on every rank
