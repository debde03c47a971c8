"""The core stays device- and kernel-agnostic: no device API outside usp_hal/dispatch/platform.py, no
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
DEVICE_LAYER = CORE / "dispatch" / "platform.py"

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


# ------------------------------------------------------------------------------ import graph
# Modules left out of the import-circle check while they are rewritten (the call pipeline's
# move out of attention.py); empty this tuple once they are done.  An entry names a module or
# a package (every module under it).
CIRCLE_CHECK_EXCLUDES: tuple = ()

# Imports of another module's private (underscore) name still allowed, as (importer, name):
# usp_hal.comm offers the same function as the public ``all_gather_single``; the sage adapter
# reads the capabilities' architecture matcher (to be made public there).
PRIVATE_IMPORTS_ALLOWED = {("usp_hal.parallel.rotation", "usp_hal.parallel.comm._all_gather_single"),
                           ("usp_hal.harness.calibrate", "usp_hal.parallel.comm._all_gather_single"),
                           ("usp_hal.backends.sage", "usp_hal.dispatch.capabilities._arch_matches")}

PURE_LEAF = "usp_hal.sequence.positions"     # pure position code: imports nothing of the package, nor torch.distributed


def _modules():
    """module name -> path, for usp_hal/ and the adapters (backends/ is ``usp_hal.backends``)."""
    mods = {}
    for base, pkg in ((CORE, "usp_hal"), (ROOT / "backends", "usp_hal.backends")):
        for path in sorted(base.rglob("*.py")):
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            if parts[:2] == ["usp_hal", "_moved"]:       # the former paths: usp_hal.comm, ... (see its docstring)
                if len(parts) == 2:
                    continue
                parts.pop(1)
            mods[".".join(parts)] = path
    return mods


def _imports(mods):
    """module -> [(imported module, imported name or None)], module-level and function-level
    imports alike (``TYPE_CHECKING`` ones included)."""
    import ast
    out = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(a.name, None) for a in node.names if a.name in mods]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for a in node.names:
                    if f"{src}.{a.name}" in mods:
                        found.append((f"{src}.{a.name}", None))
                    elif src in mods:
                        found.append((src, a.name))
        out[mod] = [(m, n) for m, n in found if m != mod]
    return out


def _excluded(mod: str, excludes) -> bool:
    return any(mod == e or mod.startswith(e + ".") for e in excludes)


def _circles(graph, excludes=CIRCLE_CHECK_EXCLUDES):
    """The strongly connected components (of 2+ modules) of the import graph."""
    edges = {m: {d for d, _ in deps if not _excluded(d, excludes)} for m, deps in graph.items()
             if not _excluded(m, excludes)}
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return comps


def _describe(graph, comps):
    return "\n".join(" <-> ".join(c) + "\n  " + "\n  ".join(
        f"{m} -> {', '.join(sorted({d for d, _ in graph[m] if d in c}))}" for m in c) for c in comps)


def test_no_import_circle_among_the_package_modules():
    graph = _imports(_modules())
    comps = _circles(graph)
    assert not comps, "import circles (module-level and function-level imports):\n" + _describe(graph, comps)


def test_no_module_imports_another_modules_private_name():
    """A private name is its module's own business; siblings inside one subpackage (harness,
    cli, backends, integrations) may share them, the layers of usp_hal may not."""
    graph = _imports(_modules())
    found = []
    for mod, deps in graph.items():
        if _excluded(mod, CIRCLE_CHECK_EXCLUDES):
            continue
        for src, name in deps:
            if not name or not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
                continue
            same_subpackage = mod.count(".") >= 2 and src.rpartition(".")[0] == mod.rpartition(".")[0]
            if not same_subpackage and (mod, f"{src}.{name}") not in PRIVATE_IMPORTS_ALLOWED:
                found.append(f"{mod} imports {src}.{name}")
    assert not found, "\n".join(found)


def test_position_code_is_a_pure_leaf():
    graph = _imports(_modules())
    assert not graph[PURE_LEAF], graph[PURE_LEAF]
    text = _modules()[PURE_LEAF].read_text()
    assert "torch.distributed" not in text and "import mesh" not in text


def test_the_circle_check_would_catch_a_circle():
    graph = {"usp_hal.a": [("usp_hal.b", None)], "usp_hal.b": [("usp_hal.c", "f")], "usp_hal.c": [("usp_hal.a", None)],
             "usp_hal.d": [("usp_hal.a", None)]}
    assert _circles(graph, ()) == [["usp_hal.a", "usp_hal.b", "usp_hal.c"]]
    assert _circles(graph, ("usp_hal.b",)) == []
    real = _imports(_modules())
    assert ("usp_hal.sequence.positions", None) in real["usp_hal.parallel.ring"] or any(
        d == "usp_hal.sequence.positions" for d, _ in real["usp_hal.parallel.ring"])


# ------------------------------------------------------------------------------ the layers
# Each layer of usp_hal may import itself and the layers named beside it, nothing above.
LAYERS = {
    "usp_hal.sequence": (),
    "usp_hal.dispatch": ("usp_hal.sequence",),
    "usp_hal.parallel": ("usp_hal.sequence", "usp_hal.dispatch"),
    "usp_hal.pipeline": ("usp_hal.sequence", "usp_hal.dispatch", "usp_hal.parallel"),
    "usp_hal.mixers": ("usp_hal.sequence", "usp_hal.dispatch", "usp_hal.parallel"),
}


# pure leaf utilities any layer may use; they import nothing of the package
LEAVES = ("usp_hal.bounded",)


def _layer_of(mod: str):
    return next((layer for layer in LAYERS if mod == layer or mod.startswith(layer + ".")), None)


def _upward_imports(graph):
    found = []
    for mod, deps in sorted(graph.items()):
        layer = _layer_of(mod)
        if layer is None:
            continue
        for dep, _ in deps:
            if _layer_of(dep) != layer and _layer_of(dep) not in LAYERS[layer] and dep not in LEAVES:
                found.append(f"{mod} -> {dep}")
    return found


def test_each_layer_imports_only_the_layers_below_it():
    bad = _upward_imports(_imports(_modules()))
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_leaves_import_nothing_of_the_package():
    graph = _imports(_modules())
    assert all(not graph[leaf] for leaf in LEAVES), {leaf: graph[leaf] for leaf in LEAVES}


def test_the_layer_check_would_catch_an_upward_import():
    graph = {"usp_hal.parallel.ring": [("usp_hal.sequence.blocks", None), ("usp_hal.pipeline.spec", "CallSpec")],
             "usp_hal.sequence.positions": [("usp_hal", None)], "usp_hal.attention": [("usp_hal.pipeline", None)]}
    assert _upward_imports(graph) == ["usp_hal.parallel.ring -> usp_hal.pipeline.spec",
                                      "usp_hal.sequence.positions -> usp_hal"]


def test_former_paths_are_the_moved_modules():
    """``usp_hal.comm`` and the other former paths are the very module objects of their new homes."""
    import importlib

    from usp_hal._moved import FORMER
    for old, new in FORMER.items():
        if old in ("usp_hal.layout", "usp_hal.varlen"):       # re-export modules: their names resolve
            mod = importlib.import_module(old)
            assert all(getattr(mod, n) is not None for n in mod.__all__), old
            continue
        assert importlib.import_module(old) is importlib.import_module(new), (old, new)
