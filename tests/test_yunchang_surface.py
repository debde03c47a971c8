"""Every public name of yunchang 0.6.4 resolves in ``usp_hal`` with yunchang's signature.

yunchang is installed ``--no-deps`` by .ci/run (it imports on a CPU machine without flash_attn:
its kernel imports are guarded, yunchang/globals.py).  It is read in a subprocess, so its
imports (triton, flash_attn when present) stay out of this process.  yunchang has no top-level
``__all__``: its public surface is what ``from yunchang import *`` gives (yunchang/__init__.py
star-imports ``hybrid`` (which has an ``__all__``), ``ring`` and ``ulysses``), less the
submodules, plus ``yunchang.kernels.AttnType`` (what its test scripts import)."""
import inspect
import json
import subprocess
import sys

import pytest
import torch

import usp_hal
from usp_hal.kernels import AttnType

_READ = r"""
import inspect, json, types, enum
import yunchang
from yunchang.kernels import AttnType
ns = {}
exec("from yunchang import *", ns)

def sig(obj):
    out = []
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self":
            continue
        d = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append([p.name, p.kind.name, d])
    return out

names = {}
for name, obj in ns.items():
    if name.startswith("_") or isinstance(obj, types.ModuleType):
        continue
    row = {"kind": type(obj).__name__}
    if isinstance(obj, type):
        row["init"] = sig(obj.__init__)
        if hasattr(obj, "forward"):
            row["forward"] = sig(obj.forward)
    elif callable(obj):
        row["sig"] = sig(obj)
    elif isinstance(obj, dict):
        row["keys"] = sorted(obj)
    names[name] = row
print(json.dumps({"version": yunchang.__version__, "names": names,
                  "attn_types": {m.name: m.value for m in AttnType}}))
"""


@pytest.fixture(scope="module")
def yunchang_surface():
    pytest.importorskip("yunchang", reason="yunchang==0.6.4 is installed --no-deps by .ci/run")
    res = subprocess.run([sys.executable, "-c", _READ], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["version"] == "0.6.4", data["version"]
    return data


def _sig(obj):
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(obj).parameters.values() if p.name != "self"]


#: defaults that differ on purpose: usp-hal picks the kernel ("auto": the first backend that runs
#: the call here) where yunchang names flash_attn's (AttnType.FA), which most machines lack
_DEFAULT_DIFFERS = {"attn_type"}


def _compatible(theirs, ours, what):
    """yunchang's parameters, in order, with their kinds and defaults, are usp_hal's; usp_hal may
    add keyword-only ones (or more positional ones with defaults where yunchang takes ``*args``)."""
    i = 0
    for name, kind, default in theirs:
        if kind == "VAR_POSITIONAL":
            while i < len(ours) and ours[i][1] == "POSITIONAL_OR_KEYWORD" and \
                    ours[i][2] is not inspect.Parameter.empty:
                i += 1
        if kind == "VAR_KEYWORD":
            while i < len(ours) and ours[i][1] == "KEYWORD_ONLY":
                i += 1
        assert i < len(ours), f"{what}: usp_hal lacks yunchang's parameter {name!r}"
        oname, okind, odefault = ours[i]
        assert (oname, okind) == (name, kind) or kind == okind == "VAR_POSITIONAL" or \
            kind == okind == "VAR_KEYWORD", f"{what}: parameter {i} is {oname} ({okind}), yunchang's {name} ({kind})"
        if default is not None and name not in _DEFAULT_DIFFERS and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            assert repr(odefault) == default, f"{what}: {name} defaults to {odefault!r}, yunchang's to {default}"
        i += 1
    for oname, okind, _ in ours[i:]:
        assert okind in ("KEYWORD_ONLY", "VAR_KEYWORD", "VAR_POSITIONAL"), \
            f"{what}: usp_hal's extra parameter {oname} ({okind}) would shift a positional call"


@pytest.mark.optional_pkg
def test_every_yunchang_name_resolves_with_its_signature(yunchang_surface):
    names = yunchang_surface["names"]
    for must in ("LongContextAttention", "LongContextAttentionQKVPacked", "AsyncLongContextAttention",
                 "UlyssesAttention", "set_seq_parallel_pg", "EXTRACT_FUNC_DICT", "RING_IMPL_QKVPACKED_DICT",
                 "ring_flash_attn_func", "zigzag_ring_flash_attn_func", "stripe_flash_attn_func"):
        assert must in names, f"{must} not read from yunchang"   # the reader itself works
    for name, row in names.items():
        ours = getattr(usp_hal, name, None)
        assert ours is not None, f"usp_hal has no {name}"
        if "init" in row:
            assert isinstance(ours, type), name
            _compatible(row["init"], _sig(ours.__init__), f"{name}.__init__")
            if "forward" in row:
                _compatible(row["forward"], _sig(ours.forward), f"{name}.forward")
        elif "sig" in row:
            assert callable(ours), name
            _compatible(row["sig"], _sig(ours), name)
        elif "keys" in row:
            assert set(row["keys"]) <= set(ours), f"{name}: keys {set(row['keys']) - set(ours)} missing"


@pytest.mark.optional_pkg
def test_every_yunchang_attn_type_resolves(yunchang_surface):
    members = yunchang_surface["attn_types"]
    assert {"AITER", "TORCH_MATH", "TORCH_CUDNN", "SAGE_FP16", "SAGE_FP16_TRITON", "SPARSE_SAGE"} <= set(members)
    no_backend = {"AITER", "SAGE_FP16", "SAGE_FP16_TRITON", "SPARSE_SAGE"}
    for name, value in members.items():
        assert name in AttnType.__members__ and usp_hal.AttnType[name] is AttnType[name], name
        for given in (AttnType[name], name, value):     # the member, its name, yunchang's value string
            if name in no_backend:
                with pytest.raises(ValueError, match=f"AttnType.{name}"):
                    usp_hal.REGISTRY.canonical_name(given)
            else:
                assert usp_hal.REGISTRY.canonical_name(given) in usp_hal.list_backends(), (name, given)


def test_torch_attn_types_are_the_sdpa_backend():
    for name in ("TORCH_MATH", "TORCH_FLASH", "TORCH_EFFICIENT", "TORCH_CUDNN"):
        assert AttnType[name] is AttnType.SDPA
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 8, generator=g, dtype=torch.float64)
    out = usp_hal.LongContextAttention(attn_type=AttnType.TORCH_MATH)(q, q, q, causal=True)
    ref, _ = usp_hal.dispatch.reference.reference_attention(q, q, q, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name,alternative", [("AITER", "'sdpa'"), ("SAGE_FP16", "'sage_fp8'"),
                                              ("SAGE_FP16_TRITON", "'sage_fp8'"), ("SPARSE_SAGE", "attn_processor")])
def test_a_member_without_backend_is_refused_at_construction(name, alternative):
    with pytest.raises(ValueError) as err:
        usp_hal.LongContextAttention(attn_type=AttnType[name])
    assert f"AttnType.{name}" in str(err.value) and alternative in str(err.value)


def test_yunchang_ring_type_names():
    for name, layout in (("strip", "stripe"), ("basic_pytorch", "basic"), ("basic_flashinfer", "basic"),
                         ("basic_npu", "basic"), ("basic", "basic"), ("zigzag", "zigzag")):
        assert usp_hal.LongContextAttention(ring_impl_type=name, attn_type="sdpa").ring_impl_type == layout
        assert name in usp_hal.EXTRACT_FUNC_DICT and name in usp_hal.RING_IMPL_DICT
    x = torch.arange(2 * 16).view(2, 16).float()
    # yunchang's stripe_extract_local: ring rank r holds r, r+R, ...; then the Ulysses ranks split it
    for rank in range(4):
        got = usp_hal.EXTRACT_FUNC_DICT["strip"](x, rank, 4, 2, 2, use_ulysses_low=True)
        r, u = divmod(rank, 2)
        assert torch.equal(got, x[:, r::2].chunk(2, dim=1)[u])
    # yunchang's basic_extract_local(value, rank, world_size): no degrees needed
    assert torch.equal(usp_hal.basic_extract_local(x, 3, 4), x.chunk(4, dim=1)[3])
