"""The README's code runs as written: its Python snippet under torchrun with 4 ranks."""
import os
import re
import subprocess
import sys

import pytest

from tests.doc_blocks import code

pytestmark = [pytest.mark.multirank, pytest.mark.slow]   # 4 ranks under torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippet() -> str:
    return code("readme-demo")          # the block marked <!-- run: readme-demo --> (tests/doc_blocks.py)


@pytest.mark.timeout(300)
def test_readme_snippet_runs_as_written_and_matches_one_device(tmp_path):
    code = _snippet()
    assert "torchrun --nproc_per_node=4" in code
    script = tmp_path / "usp_demo.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    m = re.search(r"max \|USP - single device\| = (\S+)", res.stdout)
    assert m, res.stdout[-2000:]
    assert float(m.group(1)) < 1e-4, res.stdout
