"""``usp-hal run`` with packed documents (--cu-seqlens / --docs), checked against the
per-document reference."""
import json

import pytest

from usp_hal.cli import main
from usp_hal.harness import RunConfig

pytestmark = [pytest.mark.multirank, pytest.mark.slow]   # whole CLI runs


def test_run_packed_documents_passes(tmp_path, capsys):
    path = tmp_path / "run.json"
    rc = main(["run", "--seqlen", "64", "--heads", "4", "--head-dim", "16", "--iters", "1", "--warmup", "0",
               "--ring-impl", "varlen_zigzag", "--cu-seqlens", "0,1,3,40,64", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "documents  4 packed (cu_seqlens 0,1,3,40,64; lengths 1..37)" in out, out
    assert "result: PASS" in out, out
    res = json.loads(path.read_text())
    assert res["config"]["cu_seqlens"] == "0,1,3,40,64"
    assert res["check"]["ok"] and set(res["check"]["errors"]) == {"out", "dq", "dk", "dv"}
    # kernel work summed over the ranks is every document's causal triangle, per head, forward and
    # backward: nothing between documents is scored
    visible = sum(n * (n + 1) // 2 for n in (1, 2, 37, 24))
    assert sum(r["work"] for r in res["summary"]["ranks"]) == 2 * 4 * visible


def test_run_docs_shortcut_and_bad_boundaries(capsys):
    from usp_hal.cli import build_parser
    from usp_hal.cli.run import config_from_args
    args = build_parser().parse_args(["run", "--seqlen", "50", "--docs", "3"])
    assert config_from_args(args).documents() == (0, 17, 34, 50)
    rc = main(["run", "--seqlen", "48", "--cu-seqlens", "0,30,20,48"])
    assert rc == 2 and "non-decreasing" in capsys.readouterr().err
    rc = main(["run", "--seqlen", "48", "--cu-seqlens", "0,30"])
    assert rc == 2 and "ends at 30" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:      # one or the other
        main(["run", "--seqlen", "48", "--docs", "2", "--cu-seqlens", "0,48"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_run_config_documents():
    assert RunConfig(seqlen=10).documents() is None
    assert RunConfig(seqlen=10, cu_seqlens="0,4,10").documents() == (0, 4, 10)
    with pytest.raises(ValueError, match="integers"):
        RunConfig(seqlen=10, cu_seqlens="0,a,10").documents()
