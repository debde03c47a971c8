"""yunchang 0.6.4's own test scripts run on usp_hal: tests/yunchang_port holds them, ported to
CPU/gloo with a float64 reference and the import line changed from ``yunchang`` to ``usp_hal``
(each file's header lists every change; ``git log`` shows the verbatim upstream copy first).
Every rank runs the script's own body, with yunchang's assertions and tolerances, over the
scripts' option grid: Ulysses-2, Ring-2, Ulysses-2 x Ring-2, basic and zigzag, causal, forward
and backward, and both placements of ``set_seq_parallel_pg`` (``use_ulysses_low=False`` too).
Sizes are small; the kernels are torch SDPA on bf16 as the scripts' ``torch_*`` choices ask."""
import pytest

from tests.yunchang_port import hybrid_attn, hybrid_qkvpacked_attn, ulysses_attn

SMALL = dict(nheads=4, d=16)


def _run(pools, world, fn, **kw):
    for rank, res in enumerate(pools(world).run_all(fn, timeout=120, **kw)):
        assert res[0] == "ok", f"rank {rank}: {res[1]}\n{res[2]}"


# world, sp_ulysses_degree, ring_impl_type, causal, use_ulysses_low, attn_impl, backward
HYBRID = [
    (2, 2, "basic", True, True, "torch_flash", True),          # Ulysses-2
    (2, 2, "basic", False, True, "torch_math", True),
    (2, 1, "basic", True, True, "torch_efficient", True),      # Ring-2
    (2, 1, "zigzag", True, True, "torch_flash", True),
    (2, 1, "basic_flashinfer", True, True, "torch_flash", False),   # a script choice: basic layout, forward
    (4, 2, "basic", True, True, "torch_flash", True),          # Ulysses-2 x Ring-2
    (4, 2, "zigzag", True, True, "torch_math", True),
    (4, 2, "zigzag", True, False, "torch_flash", True),        # ring-low placement (issue #38: wrong shards)
    (4, 2, "basic", True, False, "torch_cudnn", True),
]


@pytest.mark.multirank
@pytest.mark.parametrize("world,ud,ring_impl,causal,low,attn_impl,bwd", HYBRID)
def test_yunchang_hybrid_attn_script(pools, world, ud, ring_impl, causal, low, attn_impl, bwd):
    argv = ["--seqlen", "64", "--sp_ulysses_degree", str(ud), "--ring_impl_type", ring_impl,
            "--attn_impl", attn_impl] + (["--causal"] if causal else []) + (["--use_bwd"] if bwd else [])
    _run(pools, world, hybrid_attn.main, argv=argv, use_ulysses_low=low, **SMALL)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_yunchang_ulysses_attn_script(pools, world):
    _run(pools, world, ulysses_attn.main, batch_size=2, seqlen=64, **SMALL)


@pytest.mark.multirank
@pytest.mark.parametrize("world,low", [(2, True), (4, True), (4, False)])
def test_yunchang_hybrid_qkvpacked_attn_script(pools, world, low):
    # the script itself runs basic and zigzag, Ulysses-2 x Ring-(world/2), causal, forward and backward
    _run(pools, world, hybrid_qkvpacked_attn.main, batch_size=2, seqlen=64, use_ulysses_low=low, **SMALL)
