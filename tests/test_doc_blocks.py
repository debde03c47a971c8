"""Every Python block of README.md and docs/*.md runs in a test, as written, or says why it cannot
run on a CPU (tests/doc_blocks.py: the marker before each block).

A block runs by its own text; a fragment gets only what it names without defining (a tiny model
for ``model``, the inputs, the mesh the prose speaks of), put in its namespace first:
in one fresh process (ALONE), on a pool's gloo ranks (POOLED, tests/dist_doc_blocks.py), or
under ``torchrun`` (TORCHRUN: the blocks that start the process group themselves).  The
README's block runs in tests/test_readme.py (EXTERNAL)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, all_blocks, blocks_of, code, runs

# ----------------------------------------------------------------------------- where each block runs
# id -> (prelude, postlude): Python run before and after the block's text in one fresh process;
# blocks listed together share the process (and the namespace), in that order.
ALONE = {
    "backend-contract": ('''
import torch
import usp_hal
from usp_hal.backends.sdpa import SDPABackend
backend = SDPABackend()
g = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, 32, 2, 64, generator=g, dtype=torch.float64) for _ in range(4))
''', '''
from usp_hal.dispatch.reference import reference_attention
ref, ref_lse = reference_attention(q, k, v, softmax_scale=0.125, causal=True)
result = {"out": float((out - ref).abs().max()), "lse": float((lse - ref_lse).abs().max()),
          "grads": [list(t.shape) for t in (dq, dk, dv)]}
'''),
    "backend-class": ("", '''
from usp_hal import AttnRequest
result = {"reasons": MyKernelBackend.not_supported_reasons(AttnRequest(device_type="cpu"))}
'''),
    # a fragment of the class body above: the methods, in a class of their own
    "backend-packed": ("", ""),
    "backend-reasons": ("", '''
from usp_hal import AttnRequest
result["limited"] = MyLimitedBackend.not_supported_reasons(AttnRequest(device_type="cuda", num_heads=300))
'''),
    "backend-register": ("import usp_hal\n", '''
result["listed"] = "mykernel" in usp_hal.list_backends()
result["attn_type"] = attn.attn_type
'''),
    "seam-layout": ("", '''
from usp_hal.sequence.positions import LAYOUTS, local_positions
result = {"halves": sorted(int(p) for r in range(2) for p in local_positions("halves", 10, 2, 1, r, 0))}
'''),
    "seam-codec": ("", '''
result["codec"] = attn.wire
'''),
    "masks": ('''
import torch
import usp_hal
frame_tokens = 256
attn = usp_hal.LongContextAttention(attn_type="sdpa")
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2048, 2, 16, generator=g) for _ in range(3))
sink_logits = torch.zeros(2)
''', '''
result = {"out": list(out.shape), "finite": bool(torch.isfinite(out).all())}
'''),
}
GROUPS_ALONE = [("backend-contract",), ("backend-class", "backend-packed", "backend-reasons", "backend-register"),
                ("seam-layout", "seam-codec"), ("masks",)]

# ids -> (ranks, what the blocks leave that is the same on every rank); a tuple of ids runs in
# one namespace, in that order
POOLED = {("quickstart-transformers",): (2, ("loss",)), ("quickstart-fsdp",): (4, ("loss",)),
          ("quickstart-trainer",): (4, ()), ("quickstart-diffusers",): (2, ()),
          ("quickstart-diffusers-training",): (2, ("out", "loss")), ("quickstart-tiled-loss",): (2, ()),
          ("serving-cache",): (4, ("out",)), ("serving-generate", "serving-padded"): (2, ("new_tokens",)),
          ("varlen",): (2, ("full",)), ("head-parallel",): (2, ()), ("dynamic-degree",): (2, ("sched",))}

# id -> (ranks, prelude, postlude)
TORCHRUN = {"quickstart-core": (4, '''
import torch
torch.manual_seed(0)
B, S, H, Hkv, D = 1, 100, 4, 2, 16
x = torch.randn(B, S, (H + 2 * Hkv) * D)          # the global hidden states, the same on every rank


def proj(t):                                       # this rank's q, k, v from its tokens
    q, k, v = t.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.unflatten(-1, (H, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D))
''', '''
assert out.shape == (B, x_local.shape[1], H, D) and bool(torch.isfinite(out).all()), out.shape
if dist.get_rank() == 0:
    print("quickstart-core ran:", tuple(out.shape))
dist.barrier()                     # the teardown docs/quickstart.md gives: every rank done first
dist.destroy_process_group()
''')}

EXTERNAL = {"readme-demo": ("tests/test_readme.py", "test_readme_snippet_runs_as_written_and_matches_one_device")}

WRAPPED = {"backend-packed": "from usp_hal import AttentionBackend\n\n\nclass PackedMethods(AttentionBackend):\n"}


def _run_ids():
    ids = set(ALONE) | set(TORCHRUN) | set(EXTERNAL) | {i for group in POOLED for i in group}
    return ids


# ----------------------------------------------------------------------------- every block: run or marked
def _problems(blocks, ids):
    """Why the blocks fail the rule: unmarked, a run id nothing runs, a reason too short to say why."""
    out = []
    for b in blocks:
        if b.kind is None:
            out.append(f"{b.path}:{b.line}: no '<!-- run: id -->' or '<!-- not run: why -->' before the block")
        elif b.kind == "run" and b.value not in ids:
            out.append(f"{b.path}:{b.line}: run id {b.value!r} is run by no test (tests/test_doc_blocks.py)")
        elif b.kind == "not run" and len(b.value.split()) < 3:
            out.append(f"{b.path}:{b.line}: say why it cannot run on a CPU ({b.value!r})")
    return out


def test_every_python_block_is_run_or_marked_not_run():
    blocks = all_blocks()
    assert len(blocks) >= 20, len(blocks)
    problems = _problems(blocks, _run_ids())
    assert not problems, "\n".join(problems)
    marked = set(runs())
    assert marked == _run_ids(), {"run here, marked nowhere": sorted(_run_ids() - marked)}
    assert set(WRAPPED) <= set(ALONE)
    for block_id, (file, test) in EXTERNAL.items():        # the test named runs that very block
        text = (ROOT / file).read_text()
        assert re.search(rf"^def {test}\(", text, re.M) and f'code("{block_id}")' in text, (file, test)


def test_the_marker_check_would_catch_each_fault():
    text = ("<!-- run: a -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
            "<!-- not run: GPU -->\n```python\nz = 3\n```\n<!-- run: nobody -->\n\n```python\nw = 4\n```\n"
            "<!-- not run: needs a GPU (FA3) -->\n```python\nv = 5\n```\n")
    blocks = blocks_of(text, "doc.md")
    assert [(b.kind, b.value) for b in blocks] == [("run", "a"), (None, ""), ("not run", "GPU"), ("run", "nobody"),
                                                   ("not run", "needs a GPU (FA3)")]
    problems = _problems(blocks, {"a"})
    assert [p.split(":")[1] for p in problems] == ["7", "11", "16"], problems


# ----------------------------------------------------------------------------- running them
def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _script(ids) -> str:
    parts = ["import json\nresult = {}\n"]
    for block_id in ids:
        prelude, postlude = ALONE[block_id]
        text = code(block_id)
        if block_id in WRAPPED:
            text = WRAPPED[block_id] + text
        parts += [prelude, text, postlude]
    parts.append("\nprint(json.dumps(result, default=str))\n")
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ids", GROUPS_ALONE, ids=["+".join(g) for g in GROUPS_ALONE])
def test_blocks_run_in_one_process(ids, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(_script(ids))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env=_env())
    assert res.returncode == 0, res.stderr[-4000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    if "backend-contract" in ids:
        assert r["out"] < 1e-12 and r["lse"] < 1e-12 and r["grads"] == [[1, 32, 2, 64]] * 3, r
    if "backend-class" in ids:      # a CUDA-only kernel refuses a CPU call, naming the device
        assert any("cpu" in reason for reason in r["reasons"]) and r["listed"] and r["attn_type"] == "mykernel", r
        assert any("heads=300 > 256" in reason for reason in r["limited"]), r
    if "seam-layout" in ids:
        assert r["halves"] == list(range(10)), r
        assert r["codec"] == {"q": "bf16", "k": "identity", "v": "bf16", "out": "bf16"}, r
    if "masks" in ids:
        assert r == {"out": [1, 2048, 2, 16], "finite": True}, r


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ids", list(POOLED), ids=["+".join(g) for g in POOLED])
def test_blocks_run_on_ranks(pools, ids):
    for module in ("transformers", *(("diffusers",) if any("diffusers" in i for i in ids) else ())):
        pytest.importorskip(module)
    from tests import dist_doc_blocks
    ranks, same = POOLED[ids]
    res = pools(ranks).run(dist_doc_blocks.run_blocks, timeout=600, block_ids=ids)
    for r in res:
        assert all(got["finite"] for got in r.values() if isinstance(got, dict)), r
        assert set(same) <= set(r), (same, r)
        assert all(r[name] == res[0][name] for name in same), {name: [x[name] for x in res] for name in same}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(420)
@pytest.mark.parametrize("block_id", list(TORCHRUN))
def test_blocks_run_under_torchrun(block_id, tmp_path):
    ranks, prelude, postlude = TORCHRUN[block_id]
    script = tmp_path / "block.py"
    script.write_text(prelude + "\n" + code(block_id) + "\n" + postlude)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
                          str(script)], capture_output=True, text=True, timeout=360, cwd=tmp_path, env=_env())
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert f"{block_id} ran:" in res.stdout, res.stdout[-2000:]


def test_the_blocks_are_where_the_ids_say():
    """Each table's id names one block, and the block is Python that parses (a fragment of a class
    body parses once wrapped)."""
    import ast
    found = runs()
    for block_id in _run_ids():
        text = found[block_id].code
        ast.parse(WRAPPED.get(block_id, "") + text)
    assert Path(found["readme-demo"].path).name == "README.md"
