"""The core stays device- and kernel-agnostic: no device API outside usp_hal/platform.py, no
kernel package named anywhere in usp_hal/, and `import usp_hal` loads no kernel or adapter."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from usp_hal.registry import AttnType

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "usp_hal"
DEVICE_LAYER = CORE / "platform.py"

# device APIs: only the platform layer may touch them
DEVICE_PATTERNS = [r"torch\.cuda\b", r"\.cuda\("]
# kernel packages: the core never names them (adapters in backends/ do)
KERNEL_PACKAGES = ["torch_npu", "flash_attn", "sageattention", "flashinfer", "intel_extension_for_pytorch"]
# what `import usp_hal` must not pull in
FORBIDDEN_MODULES = KERNEL_PACKAGES + ["flash_attn_interface", "flash_attn_3", "flash_attn_2_cuda",
                                       "sgl_kernel", "oneccl_bindings_for_pytorch", "triton"]
BACKEND_NAMES = sorted({t.value for t in AttnType})


def _core_files():
    files = sorted(p for p in CORE.rglob("*.py") if p != DEVICE_LAYER)
    assert files, "no core sources found"
    return files


def _strip_backend_names(text: str) -> str:
    """A backend may share its name with its kernel package ("flashinfer"); naming the
    *backend* (a quoted name, or its lazy entry "usp_hal.backends.<name>") is fine, but not
    as the argument of an import or package lookup."""
    text = re.sub(r"usp_hal\.backends\.\w+", "usp_hal.backends.X", text)
    names = "|".join(map(re.escape, BACKEND_NAMES))
    lookups = "".join(rf"(?<!{re.escape(f)}\()" for f in ("find_spec", "import_module", "version", "__import__"))
    return re.sub(rf"""{lookups}(["'])({names})\1""", r"\1backend-name\1", text)


def _violations(patterns, *, strip=False):
    found = []
    for path in _core_files():
        text = path.read_text()
        if strip:
            text = _strip_backend_names(text)
        for n, line in enumerate(text.splitlines(), 1):
            for pat in patterns:
                if re.search(pat, line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_device_apis_only_in_platform():
    assert not _violations(DEVICE_PATTERNS), "\n".join(_violations(DEVICE_PATTERNS))


def test_core_names_no_kernel_package():
    pats = [rf"\b{re.escape(name)}\b" for name in KERNEL_PACKAGES]
    bad = _violations(pats, strip=True)
    assert not bad, "kernel packages belong in backends/:\n" + "\n".join(bad)


def test_the_checks_would_catch_offenders():
    sample = ('import flashinfer\nx = torch.cuda.is_available()\ny = t.cuda()\nname = "flashinfer"\n'
              'spec = find_spec("flashinfer")\nmod = "usp_hal.backends.flashinfer:FlashInferBackend"\n')
    lines = _strip_backend_names(sample).splitlines()
    assert re.search(r"\bflashinfer\b", lines[0])          # an import is caught
    assert not re.search(r"\bflashinfer\b", lines[3])      # the backend's name is not
    assert re.search(r"\bflashinfer\b", lines[4])          # a package lookup is caught
    assert not re.search(r"\bflashinfer\b", lines[5])      # the lazy registry entry is not
    assert re.search(DEVICE_PATTERNS[0], sample) and re.search(DEVICE_PATTERNS[1], sample)


def test_import_usp_hal_loads_no_kernel_and_no_adapter():
    code = (
        "import json, sys\n"
        "import usp_hal\n"
        "usp_hal.list_backends()\n"
        "mods = sorted(sys.modules)\n"
        "import torch\n"
        "print(json.dumps({'mods': mods, 'cuda_init': bool(torch.cuda.is_initialized())}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    mods = data["mods"]
    kernels = [m for m in mods if m.split(".")[0] in FORBIDDEN_MODULES]
    adapters = [m for m in mods if m == "usp_hal.backends" or m.startswith("usp_hal.backends.")]
    assert not kernels, f"`import usp_hal` imported kernel packages: {kernels}"
    assert not adapters, f"`import usp_hal` imported adapters: {adapters}"
    assert data["cuda_init"] is False
