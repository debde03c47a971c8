"""yunchang 0.6.4's ``HAS_*`` flags (yunchang/globals.py, which sets each by trying an import),
for usp_hal.compat.alias: each says whether the kernel package is installed (found by
``find_spec``, not imported)."""
from __future__ import annotations

import importlib.util
from typing import Dict

_FLAGS = {
    "HAS_FLASH_ATTN": "flash_attn",
    "HAS_FLASH_ATTN_HOPPER": "flash_attn_interface",
    "HAS_FLASHINFER": "flashinfer",
    "HAS_AITER": "aiter",
    "HAS_SAGE_ATTENTION": "sageattention",
    "HAS_SPARSE_SAGE_ATTENTION": "spas_sage_attn",
    "HAS_NPU": "torch_npu",
}


def yunchang_flags() -> Dict[str, bool]:
    return {flag: importlib.util.find_spec(pkg) is not None for flag, pkg in _FLAGS.items()}
