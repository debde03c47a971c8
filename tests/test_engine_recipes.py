"""The engine recipes of examples/engines/ (docs/engines.md): the lines each one adds for usp-hal,
counted between its ``# usp-hal: begin`` / ``# usp-hal: end`` markers, are the counts the docs
give; and each recipe, run as a user runs it (its ``main()`` on a pool's gloo ranks, the
accelerate one also under a real ``accelerate launch``), trains exactly as the same engine
without usp-hal in one process: loss, gradient norm and parameters after the steps, under
tests/test_trainer.py's bounds (the yunchang alias: output and gradients of one forward).

Adding a recipe is one file for the counting: every ``examples/engines/*.py`` is counted and must
have its row in docs/engines.md's recipe table.  A recipe is run by a case of CASES below, or by
the test its docstring names (``tests/test_x.py::test_name``)."""
from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "engines"
DOC = ROOT / "docs" / "engines.md"
BEGIN, END = "# usp-hal: begin", "# usp-hal: end"


# ----------------------------------------------------------------------------- counting (no packages)
def marked_lines(path: Path) -> list:
    """(line number, text) of each line between the markers that is neither blank nor a comment.
    Raises ValueError for markers that do not pair up."""
    out, inside = [], None
    for no, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text.startswith(BEGIN):
            if inside is not None:
                raise ValueError(f"{path.name}:{no}: '{BEGIN}' inside the block opened at line {inside}")
            inside = no
        elif text.startswith(END):
            if inside is None:
                raise ValueError(f"{path.name}:{no}: '{END}' without '{BEGIN}'")
            inside = None
        elif inside is not None and text and not text.startswith("#"):
            out.append((no, text))
    if inside is not None:
        raise ValueError(f"{path.name}: the block opened at line {inside} is not closed")
    return out


def usp_hal_uses(path: Path) -> list:
    """(line number, name) of every use of usp-hal in the code: the names bound by its imports
    (other than an engine's own class name re-bound, ``USPTrainer as Trainer``), the ``usp_*``
    arguments and ``set_attn_implementation``."""
    src = path.read_text()
    bound = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "usp_hal"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "usp_hal":
            # `USPTrainer as Trainer`: the engine's own class name kept, its uses are the plain script's
            bound |= {a.asname or a.name for a in node.names if not (a.asname and a.asname[:1].isupper())}
    uses = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME and (tok.string in bound or tok.string.startswith("usp_") or
                                          tok.string == "set_attn_implementation"):
            uses.append((tok.start[0], tok.string))
    return uses


def recipes() -> dict:
    return {p.stem: p for p in sorted(RECIPES.glob("*.py"))}


def doc_counts() -> dict:
    """{recipe: lines} from docs/engines.md's recipe table (rows ``| `examples/engines/x.py` | ... |``,
    the count in the third column)."""
    rows = re.findall(r"^\| `examples/engines/(\w+)\.py` \|[^|\n]*\| (\d+) \|", DOC.read_text(), re.M)
    return {name: int(n) for name, n in rows}


def test_every_use_of_usp_hal_in_a_recipe_is_counted():
    """register, set_attn_implementation, shard_batch, the gradient reduction...: no line that
    calls usp-hal lies outside the markers, so the count is what a user really writes."""
    assert len(recipes()) >= 9, sorted(recipes())
    for name, path in recipes().items():
        marked = {no for no, _ in marked_lines(path)}
        assert marked, f"{name}: no '{BEGIN}' block"
        outside = [(no, what) for no, what in usp_hal_uses(path) if no not in marked]
        assert not outside, f"examples/engines/{name}.py uses usp-hal outside the markers: {outside}"


def test_doc_line_counts_are_the_counted_ones():
    counted = {name: len(marked_lines(path)) for name, path in recipes().items()}
    in_doc = doc_counts()
    missing = {n: c for n, c in counted.items() if n not in in_doc}
    assert not missing, ("docs/engines.md's recipe table has no row for " + ", ".join(
        f"`examples/engines/{n}.py` ({c} lines)" for n, c in missing.items()))
    assert in_doc == counted, {n: (in_doc.get(n), c) for n, c in counted.items() if in_doc.get(n) != c}
    # and every "N lines (`examples/engines/x.py`)" in the rows says the same
    text = DOC.read_text()
    for n, name in re.findall(r"(\d+) lines? \(`examples/engines/(\w+)\.py`", text):
        assert int(n) == counted[name], (name, n, counted[name])


def test_marker_errors_are_caught(tmp_path):
    bad = tmp_path / "bad.py"
    for text, words in ((f"{BEGIN}\nx = 1\n", "not closed"), (f"{END}\n", "without"),
                        (f"{BEGIN}\n{BEGIN}\n{END}\n", "inside the block")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            marked_lines(bad)
    good = tmp_path / "good.py"
    good.write_text(f"import usp_hal\n{BEGIN}\n# a comment\n\nmesh = usp_hal.init_sequence_parallel()\n{END}\n"
                    "usp_hal.shard(x)\n")
    assert marked_lines(good) == [(5, "mesh = usp_hal.init_sequence_parallel()")]
    assert [no for no, _ in usp_hal_uses(good) if no not in {5}] == [1, 7]     # caught outside


# ----------------------------------------------------------------------------- runs (the engines)
CASES = {   # case: (recipe, ranks, main's arguments)
    "trl_sft-dp2_x_ring2": ("trl_sft", 4, dict(ulysses=1, ring=2)),
    "trl_dpo-ring2": ("trl_dpo", 2, dict(ulysses=1, ring=2)),
    "accelerate_loop-dp2_x_ring2": ("accelerate_loop", 4, dict(ulysses=1, ring=2)),
    "accelerate_trainer-dp2_x_ring2": ("accelerate_trainer", 4, dict(ulysses=1, ring=2)),
    "deepspeed_loop-zero3-dp2_x_ring2": ("deepspeed_loop", 4, dict(ulysses=1, ring=2, stage=3)),
    "deepspeed_trainer-zero3-dp2_x_ulysses2": ("deepspeed_trainer", 4, dict(ulysses=2, ring=1, stage=3)),
    "torchtitan_llama-dp2_x_ring2": ("torchtitan_llama", 4, dict(ulysses=1, ring=2)),
    "fla_gdn-ring2": ("fla_gdn", 2, dict(ulysses=1, ring=2)),
    "yunchang_alias-ulysses2_x_ring2": ("yunchang_alias", 4, dict(ulysses=2, ring=2)),
}
NEEDS = {"trl_sft": ("trl", "datasets"), "trl_dpo": ("trl", "datasets"), "accelerate_loop": (),
         "accelerate_trainer": (), "deepspeed_loop": ("deepspeed", "triton"),
         "deepspeed_trainer": ("deepspeed", "triton"), "torchtitan_llama": ("torchtitan", "triton"),
         "fla_gdn": ("fla",), "yunchang_alias": ()}


def test_every_recipe_is_run():
    for name, path in recipes().items():
        if any(recipe == name for recipe, _, _ in CASES.values()):
            continue
        named = re.findall(r"(tests/test_\w+\.py)::(\w+)", path.read_text())
        assert named, f"examples/engines/{name}.py: no case in CASES and its docstring names no test that runs it"
        for file, test in named:
            assert re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M), (name, file, test)


def _compare(res: list, ref: dict) -> dict:
    """Differences of rank 0's run from the reference; every rank logged the same losses."""
    r0 = res[0]
    assert all(r["losses"] == r0["losses"] for r in res), [r["losses"] for r in res]
    assert len(r0["losses"]) == len(ref["losses"]) >= 3, (r0["losses"], ref["losses"])
    return {"loss": max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"])),
            "norm": max(abs(a - b) / b for a, b in zip(r0["grad_norms"], ref["grad_norms"])),
            "params": float((r0["params"] - ref["params"]).abs().max()),
            "moved": float((ref["params"] - ref["initial"]).abs().max())}


@pytest.mark.models
@pytest.mark.optional_pkg
@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_recipe_matches_one_process(pools, case):
    """The recipe's main() on every rank, then the engine without usp-hal in this process."""
    name, world, kwargs = CASES[case]
    for module in ("transformers", "accelerate", *NEEDS[name]):
        pytest.importorskip(module)
    from tests import dist_engine_recipes as der
    from tests.test_trainer import LOSS_TOL, NORM_TOL, PARAM_TOL
    res = pools(world).run(der.run, timeout=600, name=name, **kwargs)
    sp = kwargs["ulysses"] * kwargs["ring"]
    ref = der.REFERENCES[name](name, world // sp)
    if name == "yunchang_alias":
        r0 = res[0]
        # float32 against float64: the largest difference relative to the largest value
        diffs = {k: float((r0[k].double() - ref[k]).abs().max() / ref[k].abs().max())
                 for k in ("output", "input_grad", "weight_grads")}
        print(f"{case}: relative to the largest value {diffs}")
        assert all(float((r["output"] - r0["output"]).abs().max()) == 0 for r in res)
        assert max(diffs.values()) < 1e-5, diffs
        return
    assert all(r["dp"] == world // sp for r in res), [r["dp"] for r in res]
    d = _compare(res, ref)
    print(f"{case}: loss diff {d['loss']:.1e}, grad-norm rel diff {d['norm']:.1e}, param diff {d['params']:.1e}")
    assert d["loss"] <= LOSS_TOL and d["norm"] <= NORM_TOL and d["params"] <= PARAM_TOL, d
    assert d["moved"] > 20 * PARAM_TOL, d                        # it trained: the comparison is not trivial
    if name.startswith("deepspeed"):                             # a DeepSpeed engine of that ZeRO stage ran
        assert all(r["zero_stage"] == kwargs["stage"] for r in res), [r["zero_stage"] for r in res]


@pytest.mark.models
@pytest.mark.optional_pkg
@pytest.mark.timeout(900)
def test_accelerate_launch_of_the_accelerate_recipe(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2 examples/engines/accelerate_loop.py``: a
    real launcher subprocess, 2 gloo ranks (Ring 2), against the plain loop in one process.  On a
    machine without GPUs ``--multi_gpu`` is accelerate's way to start the processes itself (torch's
    launcher; the script's ``Accelerator(cpu=True)`` runs them over gloo): ``--cpu`` starts one
    process unless an MPI hostfile is given (accelerate 1.15.0 commands/launch.py,
    ``simple_launcher``), which the recipe refuses by name."""
    pytest.importorskip("accelerate")
    from tests import dist_engine_recipes as der
    from tests.test_trainer import LOSS_TOL, NORM_TOL, PARAM_TOL
    out = tmp_path / "results.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    proc = subprocess.run([*launch, "--multi_gpu", "--num_processes", "2", str(RECIPES / "accelerate_loop.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=800, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert len(re.findall(r"^step \d+  loss", proc.stdout, re.M)) == 3, proc.stdout[-2000:]   # rank 0 printed
    import torch
    got = torch.load(out)
    ref = der.loop_reference("accelerate_loop", dp=1)
    d = _compare([got], ref)
    print(f"accelerate launch: loss diff {d['loss']:.1e}, grad-norm rel diff {d['norm']:.1e}, "
          f"param diff {d['params']:.1e}")
    assert got["dp"] == 1
    assert d["loss"] <= LOSS_TOL and d["norm"] <= NORM_TOL and d["params"] <= PARAM_TOL, d
    assert d["moved"] > 20 * PARAM_TOL, d


def test_docs_and_ci_install_the_engines_by_one_command():
    """docs/engines.md's install command is the one .ci/run's second tier runs, and the
    --no-deps lines live in that script alone (not in comments for users to copy)."""
    block = re.search(r"```bash\n(.+?)\n```", DOC.read_text(), re.S)
    assert block, "docs/engines.md: no bash block"
    command = block.group(1).split("#")[0].strip()
    assert command == "bash ci/install-engines.sh", command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.split("#")[0].strip() == command for line in ci), "not in .ci/run"
    assert not any("torchtitan==" in line or "deepspeed==" in line for line in ci if not line.startswith("#"))
    script = (ROOT / "ci" / "install-engines.sh").read_text()
    assert "--no-deps" in script and "'.[engines]'" in script
    assert "pip install" not in (ROOT / "pyproject.toml").read_text()        # the script is the one place
