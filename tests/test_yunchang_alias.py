"""``import yunchang`` served by usp-hal (usp_hal.compat.alias, issue #49 item 6): every
yunchang import of xfuser 0.7.0 resolves under the alias, the backed functions match one
process, and the ones usp-hal cannot honour refuse naming the alternative."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import dist_yunchang_alias
from usp_hal.compat import alias
from usp_hal.dispatch.reference import reference_attention

XFUSER_IMPORTS = Path(__file__).parent / "data" / "xfuser_0.7.0_yunchang_imports.txt"


def _pairs():
    rows = [line.split("#")[0].split() for line in XFUSER_IMPORTS.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return [(mod, None if name == "-" else name) for mod, name in rows]


@pytest.fixture
def yunchang_alias():
    """The alias installed, any yunchang modules of this process set aside and put back after."""
    saved = {n: m for n, m in sys.modules.items() if n == "yunchang" or n.startswith("yunchang.")}
    for n in saved:
        del sys.modules[n]
    try:
        yield alias.install_yunchang_alias()
    finally:
        alias.remove_yunchang_alias()
        sys.modules.update(saved)


def test_every_xfuser_yunchang_import_resolves(yunchang_alias):
    import importlib
    pairs = _pairs()
    assert len(pairs) >= 19 and ("yunchang.globals", "PROCESS_GROUP") in pairs     # the list was read
    for mod, name in pairs:
        m = importlib.import_module(mod)
        assert getattr(m, "__usp_hal_alias__", False), mod
        if name is not None:
            assert hasattr(m, name), f"from {mod} import {name}"
    # the same statements, as xfuser writes them
    ns: dict = {}
    exec("from yunchang.ring.utils import RingComm, update_out_and_lse, update_npu_out\n"
         "from yunchang.kernels import select_flash_attn_impl, AttnType\n"
         "import yunchang.comm.all_to_all\n"
         "from yunchang import LongContextAttention, set_seq_parallel_pg", ns)
    assert ns["RingComm"] is alias.RingComm and ns["set_seq_parallel_pg"] is alias.set_seq_parallel_pg
    import usp_hal
    assert ns["LongContextAttention"] is usp_hal.LongContextAttention


def test_install_logs_the_modules_it_serves_at_info(caplog):
    saved = {n: m for n, m in sys.modules.items() if n == "yunchang" or n.startswith("yunchang.")}
    for n in saved:
        del sys.modules[n]
    try:
        with caplog.at_level("INFO", logger="usp_hal.compat.alias"):
            served = alias.install_yunchang_alias()
    finally:
        alias.remove_yunchang_alias()
        sys.modules.update(saved)
    records = [r for r in caplog.records if r.name == "usp_hal.compat.alias" and r.levelname == "INFO"
               and "install_yunchang_alias" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    message = records[0].getMessage()
    assert served == list(alias.ALIAS_MODULES) and all(name in message for name in served), message


@pytest.mark.parametrize("statement", ["import yunchang.hybrid", "from yunchang import hybrid",
                                       "from yunchang.ring import zigzag_ring_flash_attn"])
def test_unserved_submodule_names_the_alias_and_what_it_serves(yunchang_alias, statement):
    """yunchang 0.6.4 has yunchang/hybrid/ and yunchang/ring/zigzag_ring_flash_attn.py; the
    alias serves neither: the error says so (still a ModuleNotFoundError for ``except``)."""
    with pytest.raises(ModuleNotFoundError) as info:
        exec(statement, {})
    assert isinstance(info.value, alias.YunchangAliasModuleNotFound), repr(info.value)
    text = str(info.value)
    assert "install_yunchang_alias" in text and "usp-hal's alias" in text, text
    assert all(name in text for name in alias.ALIAS_MODULES), text
    import yunchang.ring.utils  # the served ones still resolve
    assert yunchang.ring.utils.__usp_hal_alias__


def test_remove_takes_the_finder_out(yunchang_alias):
    alias.install_yunchang_alias()                     # twice: one finder
    assert sum(f is alias._FINDER for f in sys.meta_path) == 1
    alias.remove_yunchang_alias()
    assert alias._FINDER not in sys.meta_path and "yunchang" not in sys.modules


def test_subclass_as_xfuser_does(yunchang_alias):
    from yunchang.ring.ring_flash_attn import RingFlashAttnFunc
    from yunchang.ring.ring_npu_flash_attn import RingNpuFlashAttnFunc

    class Mine(RingFlashAttnFunc):       # xfuser/core/long_ctx_attention/ring/ring_flash_attn.py
        pass

    class MineNpu(RingNpuFlashAttnFunc):
        pass
    assert issubclass(Mine, torch.autograd.Function) and issubclass(MineNpu, torch.autograd.Function)


def test_importing_usp_hal_installs_nothing():
    code = ("import sys, usp_hal, usp_hal.compat, usp_hal.compat.alias, usp_hal.compat.yunchang\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'yunchang']\n"
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_refused_while_real_yunchang_is_imported():
    import types
    saved = sys.modules.get("yunchang")
    sys.modules["yunchang"] = types.ModuleType("yunchang")
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            alias.install_yunchang_alias()
    finally:
        if saved is None:
            del sys.modules["yunchang"]
        else:
            sys.modules["yunchang"] = saved


@pytest.mark.parametrize("call,needle", [
    (lambda: alias.update_npu_out(None, None, None, None, None, None), "softmax_max"),
    (lambda: alias.ring_npu_flash_attn_forward(None, None, None, None), "ring_npu_flash_attn_func"),
    (lambda: alias.ring_npu_flash_attn_backward(None, None, None, None, None), "autograd"),
    (lambda: alias.select_flash_attn_impl("sdpa", stage="fwd-bwd"), "fwd-only"),
    (lambda: alias.select_flash_attn_impl("sdpa", stage="bwd-only"), "ring_flash_attn_backward"),
    (lambda: alias.select_flash_attn_impl("sdpa", stage="fwd-only")(*[torch.ones(1, 2, 1, 4)] * 3,
                                                                      return_softmax=True), "probabilities"),
    (lambda: alias.ring_flash_attn_backward(None, *[torch.ones(1, 2, 1, 4)] * 6, softmax_scale=0.5,
                                            dropout_p=0.1), "dropout"),
])
def test_refusals_name_the_alternative(call, needle):
    with pytest.raises(alias.YunchangUnsupported, match=needle) as info:
        call()
    assert "use " in str(info.value)


def test_update_out_and_lse_against_float64_merge():
    """Three blocks merged one by one (yunchang's shapes: running out [B, S, H, D] float32 and lse
    [B, S, H, 1]; block lse [B, H, S]) equal the float64 log-sum-exp merge; with ``slice_``
    only the slice moves."""
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 5, 3, 4
    outs = [torch.randn(B, S, H, D, generator=g) for _ in range(3)]
    lses = [torch.randn(B, H, S, generator=g) * 3 for _ in range(3)]
    kept = [x.clone() for x in outs + lses]
    out = lse = None
    for o, l in zip(outs, lses):
        out, lse = alias.update_out_and_lse(out, lse, o, l)
    L = torch.logsumexp(torch.stack([x.double() for x in lses]), 0)                 # [B, H, S]
    want = sum(torch.exp(l.double() - L).transpose(1, 2).unsqueeze(-1) * o.double() for o, l in zip(outs, lses))
    assert out.dtype == torch.float32 and lse.shape == (B, S, H, 1)
    assert all(torch.equal(a, b) for a, b in zip(kept, outs + lses))       # the blocks are not written
    assert (out.double() - want).abs().max() < 1e-6
    assert (lse.squeeze(-1).transpose(1, 2).double() - L).abs().max() < 1e-6
    # a wrong merge (the second block's weight dropped) is caught by the same check
    bad, bad_lse = alias.update_out_and_lse(None, None, outs[0], lses[0])
    assert (bad.double() - want).abs().max() > 1e-2
    # slice_: rows 1:3 of the sequence take a fourth block, the rest stay as they were
    o4, l4 = torch.randn(B, 2, H, D, generator=g), torch.randn(B, H, 2, generator=g)
    before_out, before_lse = out.clone(), lse.clone()
    sl = (slice(None), slice(1, 3))
    out, lse = alias.update_out_and_lse(out, lse, o4, l4, slice_=sl)
    assert torch.equal(out[:, 0], before_out[:, 0]) and torch.equal(out[:, 3:], before_out[:, 3:])
    L2 = torch.logaddexp(L[:, :, 1:3], l4.double())
    want2 = torch.exp(L[:, :, 1:3] - L2).transpose(1, 2).unsqueeze(-1) * want[:, 1:3] + \
        torch.exp(l4.double() - L2).transpose(1, 2).unsqueeze(-1) * o4.double()
    assert (out[:, 1:3].double() - want2).abs().max() < 1e-6
    assert (lse[:, 1:3].squeeze(-1).transpose(1, 2).double() - L2).abs().max() < 1e-6
    assert not torch.equal(lse, before_lse)
    with pytest.raises(RuntimeError, match="slice_"):
        alias.update_out_and_lse(None, None, o4, l4, slice_=sl)


def test_select_flash_attn_impl_fwd_only():
    from usp_hal.kernels import AttnType
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    for impl in (AttnType.TORCH, "sdpa"):
        fn = alias.select_flash_attn_impl(impl, stage="fwd-only")
        out, lse = fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, return_softmax=False)
        ref, ref_lse = reference_attention(q, k, v, causal=True)
        assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


def test_globals_flags_and_singleton():
    g = alias._flags()
    assert set(g) == {"HAS_FLASH_ATTN", "HAS_FLASH_ATTN_HOPPER", "HAS_FLASHINFER", "HAS_AITER",
                      "HAS_SAGE_ATTENTION", "HAS_SPARSE_SAGE_ATTENTION", "HAS_NPU"}
    assert alias.ProcessGroupSingleton() is alias.PROCESS_GROUP


@pytest.mark.multirank
def test_all_to_all_on_two_ranks(pools):
    for errs in pools(2).run(dist_yunchang_alias.all_to_all, timeout=120):
        assert all(v == 0 for v in errs.values()), errs


@pytest.mark.multirank
@pytest.mark.parametrize("causal", [False, True])
def test_ring_forward_backward_on_two_ranks(pools, causal):
    ranks = pools(2).run(dist_yunchang_alias.ring_forward_backward, timeout=120, causal=causal)
    for errs in ranks:
        assert errs["lse_shape"] and errs["apply_none"] and errs["ringcomm"], errs
        for key in ("out", "lse", "dq", "dk", "dv", "apply_out", "apply_dq", "apply_dk"):
            assert errs[key] < 1e-10, (key, errs)
    assert max(e["bypassed"] for e in ranks) > 1e-3, ranks      # attention left local would be caught


@pytest.mark.multirank
def test_set_seq_parallel_pg_fills_process_group(pools):
    for same, u, r in pools(2).run(dist_yunchang_alias.globals_groups, timeout=120):
        assert same and (u, r) == (2, 1)
