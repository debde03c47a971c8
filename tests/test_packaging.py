"""What a wheel contains: every package of the tree, found rather than listed (a subpackage left
out of a hand-written list installed fine in editable mode and failed at import from a wheel).
The full check, a wheel installed into a fresh virtual environment and run from there, is
ci/wheel-check.sh, which .ci/run runs."""
from __future__ import annotations

import importlib.util
import re
import sys
import zipfile
from pathlib import Path

import pytest

from usp_hal.harness.installed import tree_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs the 'build' package (test extra)")
def test_wheel_holds_every_module_and_data_file(tmp_path):
    import subprocess

    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    installed = {re.sub(r"(/__init__)?\.py$", "", n).replace("/", ".") for n in names if n.endswith(".py")}
    missing = [m for m in tree_modules(ROOT) if m not in installed]
    assert not missing, f"modules of the tree missing from the wheel: {missing}"
    profiles = sorted(p.name for p in (ROOT / "usp_hal" / "profiles").glob("*.json"))
    assert profiles and all(f"usp_hal/profiles/{p}" in names for p in profiles)


def test_tree_modules_sees_every_subpackage():
    mods = set(tree_modules(ROOT))
    for sub in ("usp_hal.pipeline", "usp_hal.pipeline.agree", "usp_hal.cli.run", "usp_hal.backends.sdpa"):
        assert sub in mods
    assert "usp_hal.__main__" not in mods   # importing it would run the CLI


def test_lazy_names_are_listed():
    import usp_hal

    listed = dir(usp_hal)
    assert set(usp_hal.__all__) <= set(listed)
    assert "LongContextAttention" in listed and "shard" in listed
