"""Install a stand-in kernel package for a contract test.

A stand-in is a real directory on ``sys.path`` with the real package's import path and a
``<dist>-<version>.dist-info`` folder, so ``importlib.metadata.version`` and
``importlib.util.find_spec`` see it exactly as they would see the real distribution.
Stand-ins compute reference math on the CPU with the real package's documented quirks
(return arity, lse base/layout, masked-row values, in-place gradients).  Tests built on
them prove the *adapter*, not the kernel.
"""
from __future__ import annotations

import contextlib
import importlib
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path


def write_standin(tmp_path: Path, *, dist: str, version: str, files: dict, top_level: tuple = ()) -> tuple:
    """Write ``files`` plus dist-info metadata under a fresh site directory; returns
    ``(site, top-level module names)``.  Nothing is put on sys.path."""
    site = Path(tmp_path) / f"site-{dist}-{version}".replace("/", "_")
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
    return site, tops


def install_standin(tmp_path: Path, monkeypatch, *, dist: str, version: str, files: dict,
                    top_level: tuple = ()) -> Path:
    """Write ``files`` ({relative path: source}) plus dist-info metadata under a fresh
    site directory, put it first on sys.path, and forget any cached modules of that name.
    ``monkeypatch`` undoes the sys.path change; modules are purged again by the caller's
    fixture teardown via :func:`purge_modules`."""
    site, tops = write_standin(tmp_path, dist=dist, version=version, files=files, top_level=top_level)
    monkeypatch.syspath_prepend(str(site))
    purge_modules(tops)
    importlib.invalidate_caches()
    return site


@contextlib.contextmanager
def standin_installed(*, dist: str, version: str, files: dict, top_level: tuple = ()):
    """Install a stand-in for the duration of a ``with`` block, without pytest: for code
    that runs in other processes (the rank workers of the multi-rank tests)."""
    root = tempfile.mkdtemp(prefix="usp-hal-standin-")
    site, tops = write_standin(Path(root), dist=dist, version=version, files=files, top_level=top_level)
    sys.path.insert(0, str(site))
    purge_modules(tops)
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        if str(site) in sys.path:
            sys.path.remove(str(site))
        purge_modules(tops)
        importlib.invalidate_caches()
        shutil.rmtree(root, ignore_errors=True)


def purge_modules(names) -> None:
    for mod in list(sys.modules):
        if mod.split(".")[0] in set(names):
            del sys.modules[mod]
