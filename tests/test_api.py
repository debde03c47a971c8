"""Public API: names, constructors, meshes, shard/unshard, single-process use."""
import pytest
import torch

import usp_hal
from tests import dist_cases
from usp_hal.dispatch.reference import reference_attention


@pytest.mark.multirank
@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)])
def test_public_api_on_two_ranks(pools, U, R):
    for rep in pools(2).run(dist_cases.api_surface, U=U, R=R):
        assert all(rep[f"roundtrip_{k}"] for k in ("basic", "zigzag", "stripe")), rep
        assert rep["one_dim_class"] <= 1 and rep["packed"] <= 1 and rep["device_mesh"] <= 1, rep
        assert rep["device_mesh_degrees"] == (U, R)


@pytest.mark.multirank
def test_mesh_degree_errors(pools):
    for errs in pools(2).run(dist_cases.bad_degrees):
        assert all(e and "world size" in e or e and "positive integer" in e for e in errs), errs


@pytest.mark.multirank
def test_ring_low_and_dp_replicas(pools):
    # world 4 with a 2-rank sequence-parallel mesh: two data-parallel replicas
    for errs in pools(4).run(dist_cases.usp_case, U=1, R=2, causal=True, layout="zigzag", S=10):
        assert all(v <= 1 for v in errs.values()), errs
    for errs in pools(4).run(dist_cases.usp_case, U=2, R=1, causal=True, S=10):
        assert all(v <= 1 for v in errs.values()), errs


def test_single_process_without_process_group():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    attn = usp_hal.LongContextAttention(attn_type="auto")
    out, lse = attn(q, k, k, causal=True, return_lse=True)
    ref, ref_lse = reference_attention(q, k, k, causal=True)
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)
    assert lse.dtype == torch.float64 and out.shape == q.shape
    g1 = torch.autograd.grad(out.sum(), (q, k))
    g2 = torch.autograd.grad(ref.sum(), (q, k))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g1, g2))
    assert attn.last_backend.NAME == "sdpa"


def test_forward_only_path_saves_nothing_and_matches():
    q = torch.randn(1, 8, 2, 8)
    with torch.no_grad():
        out = usp_hal.LongContextAttention()(q, q, q, causal=True)
    assert out.grad_fn is None
    ref, _ = reference_attention(q, q, q, causal=True)
    assert torch.allclose(out.double(), ref, atol=2e-6)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(scatter_idx=1), "scatter_idx"),
    (dict(attn_type="nope"), "valid options"),
    (dict(ring_impl_type="spiral"), "valid: basic, zigzag, stripe"),
    (dict(rotation="ring"), "valid: p2p, allgather"),
    (dict(attn_processor=object()), "must be callable"),
    (dict(attn_processor=lambda *a, **k: None, attn_type="sdpa"), "SPARSE_SAGE"),
    (dict(attn_processor=lambda *a, **k: None, attn_type=usp_hal.AttnType.FA), "leave it unused"),
])
def test_constructor_errors(kwargs, needle):
    with pytest.raises((ValueError, NotImplementedError, TypeError), match=needle):
        usp_hal.LongContextAttention(**kwargs)


@pytest.mark.parametrize("call,needle", [
    (lambda a, q: a(q[0], q[0], q[0]), "batch, seq, heads, head_dim"),
    (lambda a, q: a(q, q[:, :, :3], q[:, :, :3]), "multiple of key/value heads"),
    (lambda a, q: a(q, q.double(), q), "dtypes differ"),
    (lambda a, q: a(q, q, q, window_size=(-3, 0)), "window_size"),
    (lambda a, q: a(q, q, q, dropout_p=0.1), "dropout"),
    (lambda a, q: a(q, q, q, softcap=5.0), "softcap"),
    (lambda a, q: a(q, q, q, alibi_slopes=torch.ones(3)), "alibi_slopes"),
])
def test_local_validation_errors(call, needle):
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises((ValueError, NotImplementedError, TypeError), match=needle):
        call(usp_hal.LongContextAttention(attn_type="sdpa"), q)


def test_yunchang_names_accepted():
    for name in ("TORCH", "TORCH_EFFICIENT", usp_hal.AttnType.SDPA, "sdpa", "auto"):
        usp_hal.LongContextAttention(attn_type=name)


def test_import_is_light():
    import subprocess
    import sys
    code = ("import sys, usp_hal; bad=[m for m in sys.modules if m.split('.')[0] in "
            "('flash_attn','flash_attn_interface','sageattention','flashinfer','torch_npu',"
            "'intel_extension_for_pytorch','matplotlib')]; print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_documented_names_reachable_after_plain_import():
    """Every module the docs name is an attribute of the package after ``import usp_hal``."""
    import subprocess
    import sys
    code = ("import usp_hal\n"
            "usp_hal.sequence.positions.local_positions; usp_hal.dispatch.platform.default_device_type\n"
            "usp_hal.parallel.mesh.SequenceParallelMesh\n"
            "usp_hal.dispatch.reference.reference_attention; usp_hal.SequenceParallelMesh.local_positions\n"
            "usp_hal.shard; usp_hal.unshard; usp_hal.LongContextAttention\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_all_lists_usp_hal_names_and_yunchang_names_still_resolve():
    """``usp_hal.__all__`` is usp-hal's own surface; yunchang's extra names resolve from
    ``usp_hal`` without being listed, and usp_hal.compat.YUNCHANG_NAMES lists them."""
    from usp_hal import compat
    assert not set(compat.YUNCHANG_NAMES) & set(usp_hal.__all__)
    assert len(compat.YUNCHANG_NAMES) == len(set(compat.YUNCHANG_NAMES)) == 24
    for name in compat.YUNCHANG_NAMES:
        assert getattr(usp_hal, name) is getattr(compat, name) is getattr(compat.yunchang, name), name
        assert name in dir(usp_hal)
    for name in usp_hal.__all__:
        assert getattr(usp_hal, name) is not None, name
