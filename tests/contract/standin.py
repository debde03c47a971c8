"""Install a stand-in kernel package for a contract test.

A stand-in is a real directory on ``sys.path`` with the real package's import path and a
``<dist>-<version>.dist-info`` folder, so ``importlib.metadata.version`` and
``importlib.util.find_spec`` see it exactly as they would see the real distribution.
Stand-ins compute reference math on the CPU with the real package's documented quirks
(return arity, lse base/layout, masked-row values, in-place gradients).  Tests built on
them prove the *adapter*, not the kernel.
"""
from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path


def install_standin(tmp_path: Path, monkeypatch, *, dist: str, version: str, files: dict,
                    top_level: tuple = ()) -> Path:
    """Write ``files`` ({relative path: source}) plus dist-info metadata under a fresh
    site directory, put it first on sys.path, and forget any cached modules of that name.
    ``monkeypatch`` undoes the sys.path change; modules are purged again by the caller's
    fixture teardown via :func:`purge_modules`."""
    site = tmp_path / f"site-{dist}-{version}".replace("/", "_")
    site.mkdir(parents=True, exist_ok=True)
    tops = set(top_level)
    for rel, src in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
        tops.add(Path(rel).parts[0].removesuffix(".py"))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("\n".join(sorted(tops)) + "\n")
    monkeypatch.syspath_prepend(str(site))
    purge_modules(tops)
    importlib.invalidate_caches()
    return site


def purge_modules(names) -> None:
    for mod in list(sys.modules):
        if mod.split(".")[0] in set(names):
            del sys.modules[mod]
