"""The compat map (usp_hal/_moved/): every former import path still imports, as the very module
of its new home (or, for the two split modules, the very objects of their names), and warns
once with a DeprecationWarning naming the new path and the version that removes it.

This file and the map are the only places of the repository that name former paths
(tests/test_hygiene.py checks the rest)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from usp_hal._moved import MOVED, REMOVED_IN, SPLIT, message

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (nothing imported yet), every warning recorded."""
    prelude = "import json, warnings\nwarnings.simplefilter('always')\n"
    res = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=240,
                         cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_former_path_is_its_new_module_and_warns_once_naming_it():
    r = _run(f'''
import importlib
out = {{}}
for old, new in {MOVED!r}.items():
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        a = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        b = importlib.import_module(old)
    out[old] = {{"same": a is importlib.import_module(new) and b is a,
                "first": [(w.category.__name__, str(w.message)) for w in first],
                "again": [str(w.message) for w in again]}}
print(json.dumps(out))
''')
    assert sorted(r) == sorted(MOVED)
    for old, new in MOVED.items():
        got = r[old]
        assert got["same"], old
        mine = [m for c, m in got["first"] if m.startswith(old + " ")]
        assert mine == [message(old)], (old, got["first"])
        assert all(c == "DeprecationWarning" for c, m in got["first"] if m in mine)
        assert new in mine[0] and REMOVED_IN in mine[0], mine
        assert got["again"] == [], (old, got["again"])        # once


def test_split_modules_serve_the_same_objects():
    r = _run(f'''
import importlib
out = {{}}
for old, names in {SPLIT!r}.items():
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    out[old] = {{"same": [getattr(mod, n) is getattr(importlib.import_module(home), n) for n, home in names.items()],
                "all": sorted(mod.__all__),
                "warned": [str(w.message) for w in first if w.category is DeprecationWarning]}}
print(json.dumps(out))
''')
    for old, names in SPLIT.items():
        assert all(r[old]["same"]) and r[old]["all"] == sorted(names), r[old]
        assert r[old]["warned"] == [message(old)], r[old]


def test_the_warning_points_at_the_importing_line_and_the_attribute_form_warns_too():
    r = _run('''
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    from usp_hal import comm                        # the attribute form of a former path
    import usp_hal.parallel.comm as new
dep = [x for x in w if x.category is DeprecationWarning]
print(json.dumps({"same": comm is new, "n": len(dep), "file": dep[0].filename, "line": dep[0].lineno}))
''')
    assert r["same"] and r["n"] == 1, r
    assert r["file"] == "<string>" and r["line"] == 6, r     # the `from usp_hal import comm` line


def test_an_attribute_set_through_a_former_path_reaches_the_code():
    """integrations.hybrid, .trainer, .grads and .tiled_loss are the moved modules themselves
    (one object: an attribute set through the old name reaches the code that reads it)."""
    pytest.importorskip("transformers")
    r = _run(r'''
import usp_hal.integrations as integ
from usp_hal.integrations import grads, hybrid, sequence_mixers, tiled_loss, trainer
from usp_hal.integrations.training import grads as g2, tiled_loss as t2, trainer as tr2
from usp_hal.integrations.hybrid import SequenceMixerError, find_sequence_mixers
import usp_hal.comm, usp_hal.parallel.comm
hybrid.CONV_EXCHANGE = "head_parallel"
usp_hal.comm.PROBE_ATTRIBUTE = 7
print(json.dumps({"same": [hybrid is sequence_mixers, grads is g2, tiled_loss is t2, trainer is tr2,
                           integ.sync_gradients is g2.sync_gradients,
                           find_sequence_mixers is sequence_mixers.find_sequence_mixers,
                           issubclass(SequenceMixerError, NotImplementedError)],
                  "conv": sequence_mixers.CONV_EXCHANGE,
                  "probe": getattr(usp_hal.parallel.comm, "PROBE_ATTRIBUTE", None)}))
''')
    assert all(r["same"]) and r["conv"] == "head_parallel" and r["probe"] == 7, r


def test_every_former_path_has_its_file_and_every_file_its_entry():
    files = {f"usp_hal.{p.stem}" for p in (ROOT / "usp_hal" / "_moved").glob("*.py") if p.stem != "__init__"}
    files |= {f"usp_hal.integrations.{p.stem}" for p in (ROOT / "usp_hal" / "integrations").glob("*.py")
              if "redirect(__name__)" in p.read_text()}
    assert files == set(MOVED) | set(SPLIT)
    for new in MOVED.values():
        assert new not in MOVED and (ROOT / (new.replace(".", "/") + ".py")).exists() or \
            (ROOT / new.replace(".", "/") / "__init__.py").exists(), new
    assert REMOVED_IN.count(".") == 2
