"""`usp-hal matrix`: CI matrices and docs generated from the declarations, the ci/ files,
and one verification per matrix entry on this machine (the device part of CI)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from usp_hal.cli import main
from usp_hal.dispatch import platform
from usp_hal.dispatch.backend import AttentionBackend
from usp_hal.dispatch.capabilities import Package, parse_dtype
from usp_hal.dispatch.registry import REGISTRY, Registry
from usp_hal.harness import matrix
from usp_hal.harness.verify import FEATURES, base_request, supported_features, verify_backend

ROOT = Path(__file__).resolve().parents[1]
CPU_ONLY = platform.available_device_types() == ("cpu",)


class TinyHopper(AttentionBackend):
    """Shipped-looking (module under usp_hal.backends), CUDA sm90+, half dtypes, forward-only,
    no lse, with a package extra."""
    __module__ = "usp_hal.backends._tiny_hopper"
    NAME = "tinyhopper"
    DESCRIPTION = "a test kernel | with a pipe"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MAX = 256
    HEAD_DIM_MULTIPLE = 8
    SUPPORTS_SOFTCAP = True
    RETURNS_LSE = False
    HAS_BACKWARD = False
    MIN_COMPUTE_CAPABILITY = {"cuda": (9, 0)}
    REQUIRED_PACKAGES = (Package("tiny-hopper-kernels", "tiny_hopper_kernels", extra="tiny"),)


class ThirdPartyPlugin(AttentionBackend):
    __module__ = "someone_elses_package.attn"
    NAME = "plugin"
    SUPPORTED_DEVICES = frozenset({"cpu"})
    SUPPORTED_DTYPES = frozenset({torch.float32})


@pytest.fixture
def reg():
    """sdpa + test backends only: independent of which kernel adapters import here."""
    r = Registry()
    for name in list(r.names()):
        if name != "sdpa":
            r.unregister(name)
    r.register("tinyhopper", TinyHopper)
    r.register("plugin", ThirdPartyPlugin)
    return r


def _entries(reg, profile):
    return matrix.matrix_entries(matrix.PROFILES[profile], reg)


# ----------------------------------------------------------------------------- generation
def test_profiles():
    assert set(matrix.PROFILES) == {"cpu", "cuda-sm80", "cuda-sm90", "rocm", "npu", "xpu"}
    assert matrix.PROFILES["cuda-sm80"].compute_capability == (8, 0)
    assert matrix.PROFILES["cuda-sm90"].compute_capability == (9, 0)
    for p in matrix.PROFILES.values():
        assert p.device_type in platform.DEVICE_TYPES
    with pytest.raises(ValueError, match="valid: cpu, cuda-sm80"):
        matrix.get_profile("cuda-sm75")


@pytest.mark.skipif(not CPU_ONLY, reason="the machine profile is cpu only without accelerators")
def test_machine_profile_is_cpu_here():
    assert matrix.machine_profile().name == "cpu"
    assert matrix.get_profile("auto").name == "cpu"


def test_cpu_matrix(reg):
    entries = _entries(reg, "cpu")
    assert [(e["backend"], e["dtype"]) for e in entries] == [
        ("sdpa", "fp64"), ("sdpa", "fp32"), ("sdpa", "bf16"), ("sdpa", "fp16")]
    e = entries[0]
    assert e["profile"] == "cpu" and e["device"] == "cpu" and e["compute_capability"] is None
    assert {f: e[f] for f in FEATURES} == {"fwd": True, "bwd": True, "ring": True, "causal": True,
                                           "window": True, "softcap": False, "gqa": True}
    assert e["extra"] == ""


def test_device_rules_and_compute_capability_decide_entries(reg):
    sm80 = _entries(reg, "cuda-sm80")
    sm90 = _entries(reg, "cuda-sm90")
    # sdpa refuses fp64 off the cpu (a declared Limit), on every CUDA profile
    assert [e["dtype"] for e in sm80 if e["backend"] == "sdpa"] == ["fp32", "bf16", "fp16"]
    assert "tinyhopper" not in {e["backend"] for e in sm80}          # needs sm90
    hopper = [e for e in sm90 if e["backend"] == "tinyhopper"]
    assert [e["dtype"] for e in hopper] == ["bf16", "fp16"]
    for e in hopper:
        assert e["compute_capability"] == "9.0"
        assert (e["bwd"], e["ring"], e["softcap"], e["window"]) == (False, False, True, False)
        assert e["extra"] == "tiny"
        assert e["head_dim"] % 8 == 0
    assert not _entries(reg, "npu")
    assert {e["backend"] for e in _entries(reg, "rocm")} == {"sdpa"}


def test_entries_agree_with_not_supported_reasons(reg):
    for name, profile in matrix.PROFILES.items():
        for e in _entries(reg, name):
            cls = reg.get(e["backend"])
            base = base_request(cls, e["device"], parse_dtype(e["dtype"]), profile.compute_capability)
            assert not cls.not_supported_reasons(base)
            assert supported_features(cls, base) == {f: e[f] for f in FEATURES}


def test_plugins_are_not_in_project_matrices_or_docs(reg):
    assert "plugin" not in {e["backend"] for e in _entries(reg, "cpu")}
    assert "plugin" not in matrix.generate_docs(reg)
    assert [c.NAME for c in matrix.project_backends(reg)] == ["sdpa", "tinyhopper"]


def test_a_shipped_adapter_that_fails_to_import_is_an_error(reg):
    reg.register("ghost", "usp_hal.backends._no_such_adapter:Ghost")
    with pytest.raises(RuntimeError, match="'ghost' could not be imported"):
        matrix.matrix_entries(matrix.PROFILES["cpu"], reg)


def test_entries_are_a_flat_github_include_list(reg):
    for e in _entries(reg, "cuda-sm90"):
        assert all(isinstance(v, (str, bool, int, type(None))) for v in e.values()), e


# ----------------------------------------------------------------------------- CLI
def test_cli_json_markdown_extras(capsys, monkeypatch, reg):
    monkeypatch.setattr(matrix, "REGISTRY", reg)
    assert main(["matrix", "--device", "cuda-sm90"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == _entries(reg, "cuda-sm90")
    assert main(["matrix"]) == 0                                       # all profiles
    assert {e["profile"] for e in json.loads(capsys.readouterr().out)} == {"cpu", "cuda-sm80", "cuda-sm90", "rocm"}
    assert main(["matrix", "--device", "cuda-sm90", "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert "### cuda-sm90 (cuda, compute capability 9.0)" in md
    assert "| sdpa | fp32, bf16, fp16 | yes | yes | yes | yes | yes | no | yes |" in md
    assert "| tinyhopper | bf16, fp16 | yes | no | no | yes | no | yes | yes |" in md
    assert main(["matrix", "--device", "cuda-sm90", "--format", "extras"]) == 0
    assert capsys.readouterr().out.strip() == "tiny"
    assert main(["matrix", "--device", "cuda-sm90", "--format", "source-built"]) == 0
    assert capsys.readouterr().out.strip() == ""
    assert main(["matrix", "--device", "cpu", "--format", "extras"]) == 0
    assert capsys.readouterr().out.strip() == ""


def test_cli_unknown_profile(capsys):
    assert main(["matrix", "--device", "tpu"]) == 2
    assert "unknown profile 'tpu'" in capsys.readouterr().err


def test_cli_docs_write_and_check(tmp_path, capsys, monkeypatch, reg):
    monkeypatch.setattr(matrix, "REGISTRY", reg)
    path = tmp_path / "docs" / "backends.md"
    assert main(["matrix", "--docs", str(path), "--check"]) == 1      # missing
    assert "stale" in capsys.readouterr().err
    assert main(["matrix", "--docs", str(path)]) == 0
    assert path.read_text() == matrix.generate_docs(reg)
    assert main(["matrix", "--docs", str(path), "--check"]) == 0
    path.write_text(path.read_text().replace("| yes |", "| no |", 1))
    assert main(["matrix", "--docs", str(path), "--check"]) == 1


def test_docs_content(reg):
    text = matrix.generate_docs(reg)
    first = text.splitlines()[0]
    assert "Generated by `usp-hal matrix --docs`" in first
    assert "|  | sdpa | tinyhopper |" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and line.count("|") == 4}
    assert rows["devices"] == ["cpu, cuda, rocm", "cuda"]
    assert rows["dtypes"] == ["fp64, fp32, bf16, fp16 (cpu); fp32, bf16, fp16 (cuda, rocm)", "bf16, fp16"]
    assert rows["head dims"] == ["1..any; V may differ", "1..256, multiple of 8"]
    assert rows["backward"] == ["yes", "no"]
    assert rows["ring (returns lse)"] == ["yes", "no"]
    assert rows["limited to Ulysses-only meshes"] == ["no", "yes (no lse)"]
    assert rows["window/alibi across ring blocks"] == ["yes", "n/a"]
    assert rows["softcap"] == ["no", "yes"]
    assert rows["deterministic backward"] == ["yes (cpu); no (cuda, rocm)", "n/a (no backward)"]
    assert rows["compute capability"] == ["-", "cuda 9.0"]
    assert rows["input strides taken as they are"] == ["last-dim-contiguous", "strided"]
    assert rows["packages"] == ["torch only", "`tiny-hopper-kernels` (`usp-hal[tiny]`)"]
    assert "- **tinyhopper**: a test kernel | with a pipe" in text


def test_docs_list_every_declared_limit_with_its_source():
    text = matrix.generate_docs()
    for cls in matrix.project_backends():
        for lim in cls.LIMITS:
            assert lim.source, f"{cls.NAME}: a declared limit without its source: {lim.reason}"
            assert matrix.reason_text(lim.reason).replace("|", "\\|") in text
        for _fact, src in cls.UPSTREAM_CHECKED:
            assert src.replace("|", "\\|") in text
    assert "## What was checked against which upstream source" in text


def test_source_built_packages_are_not_in_the_default_extras():
    entries = matrix.matrix_entries(matrix.PROFILES["cuda-sm90"])
    assert matrix.profile_extras(entries, wheels_only=True) == ["flashinfer", "sage"]
    assert "fa2" in matrix.profile_extras(entries)
    assert matrix.source_built_backends(entries) == ["fa2", "fa3"]


def test_docs_backends_md_is_up_to_date():
    """docs/backends.md is generated: regenerate with `usp-hal matrix --docs` after changing
    a backend declaration."""
    present = matrix.installed_kernel_packages()
    if present:
        pytest.skip(f"kernel packages installed here ({', '.join(present)}): version-dependent rules "
                    "differ from the page, which is generated without them")
    path = ROOT / "docs" / "backends.md"
    assert path.exists(), "docs/backends.md is missing: run `usp-hal matrix --docs`"
    assert path.read_text() == matrix.generate_docs(), "docs/backends.md is stale: run `usp-hal matrix --docs`"


def test_real_registry_cpu_matrix_has_sdpa(capsys):
    assert main(["matrix", "--device", "cpu"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert {e["dtype"] for e in entries if e["backend"] == "sdpa"} == {"fp64", "fp32", "bf16", "fp16"}
    for e in entries:
        assert "cpu" in REGISTRY.get(e["backend"]).SUPPORTED_DEVICES


# ----------------------------------------------------------------------------- ci/ files
WORKFLOWS = ROOT / "ci" / "workflows"


def _workflows():
    yaml = pytest.importorskip("yaml")
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.yml"))}


def test_workflows_cover_every_profile_on_self_hosted_runners():
    flows = _workflows()
    assert set(flows) == {"cpu", "cuda", "rocm", "npu", "xpu"}
    covered = set()
    for name, wf in flows.items():
        assert (wf.get("on") or wf.get(True)), f"{name}.yml has no trigger"
        for job in wf["jobs"].values():
            assert "self-hosted" in job["runs-on"]
            profiles = job["strategy"]["matrix"]["profile"]
            for p in profiles:
                assert p in matrix.PROFILES, f"{name}.yml runs unknown profile {p}"
                assert matrix.PROFILES[p].device_type == name, f"{name}.yml runs {p}"
            covered.update(profiles)
            runs = " ".join(step.get("run", "") for step in job["steps"])
            for step in ("install", "probe", "test"):
                assert f"ci/run-device.sh ${{{{ matrix.profile }}}} {step}" in runs
    assert covered == set(matrix.PROFILES)


def test_run_device_script():
    script = ROOT / "ci" / "run-device.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(script)], check=True)
    text = script.read_text()
    for needle in ("usp_hal probe --verify", "usp_hal matrix --device", "USP_HAL_MATRIX=", "--format extras"):
        assert needle in text


# ----------------------------------------------------------------------------- entries on this device
def _load_entries():
    """Entries from USP_HAL_MATRIX (a path, or inline JSON of one entry or a list), else the
    matrix of this machine's profile.  A generation error becomes a failing case."""
    src = os.environ.get("USP_HAL_MATRIX")
    try:
        if src:
            text = src if src.lstrip().startswith(("[", "{")) else Path(src).read_text()
            data = json.loads(text)
            return (data if isinstance(data, list) else [data]), None
        return matrix.matrix_entries(matrix.machine_profile()), None
    except Exception as exc:
        return [], f"{type(exc).__name__}: {exc}"


_ENTRIES, _ENTRIES_ERROR = _load_entries()


@pytest.mark.parametrize(
    "entry", _ENTRIES or [None],
    ids=[f"{e['profile']}/{e['backend']}/{e['dtype']}" for e in _ENTRIES] or ["no-entries"])
def test_matrix_entry(entry):
    """One CI matrix entry: that backend, that dtype, every listed feature, on this device."""
    if _ENTRIES_ERROR:
        pytest.fail(f"could not build the matrix: {_ENTRIES_ERROR}")
    if entry is None:
        pytest.skip("the matrix for this machine is empty")
    dev = entry["device"]
    assert dev in platform.available_device_types(), \
        f"entry for {dev}, but this machine has {', '.join(platform.available_device_types())}"
    cls = REGISTRY.get(entry["backend"])
    avail = cls.availability()
    if not avail.ok:
        optional = {n.strip() for n in os.environ.get("USP_HAL_MATRIX_OPTIONAL", "").split(",") if n.strip()}
        msg = f"{entry['backend']} is unavailable here: {avail.reason}"
        if entry["backend"] in optional:
            pytest.skip(msg + " (listed in USP_HAL_MATRIX_OPTIONAL)")
        pytest.fail(msg)
    cc = tuple(int(x) for x in entry["compute_capability"].split(".")) if entry["compute_capability"] else None
    base = base_request(cls, dev, parse_dtype(entry["dtype"]), cc)
    assert supported_features(cls, base) == {f: entry[f] for f in FEATURES}, \
        "the matrix file no longer matches the declarations: regenerate it with `usp-hal matrix`"
    rows = verify_backend(cls, dev, dtypes=[entry["dtype"]], features=entry)
    bad = [r for r in rows if r["status"] != "pass"]
    assert rows and not bad, "\n".join(f"{r['case']}: {r['status']}: {r['reason']} {r['errors']}" for r in bad)
    cases = {r["case"] for r in rows}
    if entry["window"]:
        assert "window" in cases
    if entry["gqa"]:
        assert cases & {"gqa", "gqa-causal"}
