"""The core stays device- and kernel-agnostic: no device API outside usp_hal/dispatch/platform.py, no
kernel package named anywhere in usp_hal/, and `import usp_hal` loads no kernel or adapter.  The
modules import downward only, write nothing into another module at import, and the repository
names its modules by their current paths only (the former ones live in the compat map,
usp_hal/_moved/, and its test, tests/test_moved.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from usp_hal.dispatch.registry import AttnType

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
# usp_hal.parallel.comm offers the same function as the public ``all_gather_single``; the sage adapter
# reads the capabilities' architecture matcher (to be made public there).
PRIVATE_IMPORTS_ALLOWED = {("usp_hal.parallel.rotation", "usp_hal.parallel.comm._all_gather_single"),
                           ("usp_hal.harness.calibrate", "usp_hal.parallel.comm._all_gather_single"),
                           ("usp_hal.backends.sage", "usp_hal.dispatch.capabilities._arch_matches")}

PURE_LEAF = "usp_hal.sequence.positions"     # pure position code: imports nothing of the package, nor torch.distributed


def _is_former_path(path: Path) -> bool:
    """A file of the compat map: usp_hal/_moved/ and the former paths' files elsewhere (they
    only call its redirect with their own name)."""
    return "_moved" in path.relative_to(ROOT).parts or "redirect(__name__)" in path.read_text()


def _modules():
    """module name -> path, for usp_hal/ and the adapters (backends/ is ``usp_hal.backends``),
    the compat map left out."""
    mods = {}
    for base, pkg in ((CORE, "usp_hal"), (ROOT / "backends", "usp_hal.backends")):
        for path in sorted(base.rglob("*.py")):
            if _is_former_path(path):
                continue
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _source(node, package: str) -> str:
    """The absolute module a ``from ... import`` names, resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


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
                src = _source(node, package)
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
    "usp_hal.planning": ("usp_hal.sequence", "usp_hal.dispatch", "usp_hal.parallel"),
}

# The faces sit on the layers: the top-level modules (``usp_hal`` itself, attention, overlap,
# kernels, bounded, lazy), ``serving`` and ``compat``; none of them may import what sits on them
# (``usp_hal.__main__`` is the CLI's entry point, part of it; the adapters are plugged in below).
FACES = ("usp_hal.serving", "usp_hal.compat")
ABOVE_THE_FACES = ("usp_hal.integrations", "usp_hal.harness", "usp_hal.cli", "usp_hal.__main__")
NOT_FACES = ABOVE_THE_FACES + ("usp_hal.backends",)


# pure leaf utilities any layer may use; they import nothing of the package
LEAVES = ("usp_hal.bounded", "usp_hal.lazy")


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


def _is_face(mod: str) -> bool:
    top = mod.count(".") <= 1 and _layer_of(mod) is None and not _excluded(mod, NOT_FACES)
    return top or _excluded(mod, FACES)


def _face_imports(graph):
    """Imports of a face (a top-level module, serving, compat) from integrations, harness or cli."""
    return [f"{mod} -> {dep}" for mod, deps in sorted(graph.items()) if _is_face(mod)
            for dep, _ in deps if _excluded(dep, ABOVE_THE_FACES)]


def test_the_faces_import_nothing_above_them():
    graph = _imports(_modules())
    faces = sorted(m for m in graph if _is_face(m))
    assert {"usp_hal", "usp_hal.attention", "usp_hal.serving.kv_cache", "usp_hal.compat.alias"} <= set(faces), faces
    assert not any(_layer_of(m) or _excluded(m, ABOVE_THE_FACES) for m in faces), faces
    bad = _face_imports(graph)
    assert not bad, "the faces import what sits on them (docs/architecture.md):\n" + "\n".join(bad)


def test_the_face_check_would_catch_an_import_from_above():
    graph = {"usp_hal.serving.kv_cache": [("usp_hal.integrations.training.grads", "watch")],
             "usp_hal.overlap": [("usp_hal.harness.meter", None)], "usp_hal.compat.alias": [("usp_hal.cli", None)],
             "usp_hal.integrations.trl": [("usp_hal.harness", None)]}
    assert _face_imports(graph) == ["usp_hal.compat.alias -> usp_hal.cli", "usp_hal.overlap -> usp_hal.harness.meter",
                                    "usp_hal.serving.kv_cache -> usp_hal.integrations.training.grads"]


# ------------------------------------------------------------------------------ writes at import
# Importing a module changes no other module: it binds no name in another module's namespace and
# fills no table of another module (a dict, list or set held at module level), whether by
# assignment or through a call.  Checked by importing every module in turn in one interpreter
# and comparing, around each import, the namespaces of the modules already imported.
WRITES_PROBE = r"""
import importlib, json, sys, types

def fingerprint(value):
    if isinstance(value, (dict, set, list)):
        try:
            keys = sorted(map(repr, value)) if isinstance(value, (dict, set)) else list(map(id, value))
        except Exception:
            keys = len(value)
        items = [id(v) for v in value.values()] if isinstance(value, dict) else None
        return [id(value), keys, items]
    return id(value)

def namespace(mod):
    return {k: fingerprint(v) for k, v in list(vars(mod).items())
            if not (k.startswith("__") and k.endswith("__")) and not isinstance(v, types.ModuleType)}

found = []
for name in json.loads(sys.argv[1]):
    before = {m: namespace(mod) for m, mod in list(sys.modules.items())
              if m.split(".")[0] == "usp_hal" and isinstance(mod, types.ModuleType)}
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    for m, names in before.items():
        now = namespace(sys.modules[m])
        found += [f"importing {name} changed {m}.{k}" for k in sorted(set(names) | set(now))
                  if names.get(k) != now.get(k)]
print(json.dumps(found))
"""


def _import_time_writes(names):
    res = subprocess.run([sys.executable, "-c", WRITES_PROBE, json.dumps(names)], capture_output=True, text=True,
                         timeout=240, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_no_module_writes_into_another_at_import():
    names = sorted(m for m in _modules() if m != "usp_hal.__main__")
    found = _import_time_writes(names)
    assert not found, "\n".join(found)


def test_the_write_check_would_catch_a_write(tmp_path, monkeypatch):
    pkg = tmp_path / "usp_hal_probe_pkg"
    (pkg).mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("TABLE = {}\nhook = None\n")
    (pkg / "high.py").write_text("from . import low\nlow.hook = print\nlow.TABLE['x'] = 1\n")
    probe = WRITES_PROBE.replace('m.split(".")[0] == "usp_hal"', 'm.split(".")[0] == "usp_hal_probe_pkg"')
    res = subprocess.run([sys.executable, "-c", probe, json.dumps(["usp_hal_probe_pkg.low", "usp_hal_probe_pkg.high"])],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found == ["importing usp_hal_probe_pkg.high changed usp_hal_probe_pkg.low.TABLE",
                     "importing usp_hal_probe_pkg.high changed usp_hal_probe_pkg.low.hook"], found


# ------------------------------------------------------------------------------ one set of names
# A former path may be named only by the compat map (usp_hal/_moved/, with the former paths'
# own files) and its test (tests/test_moved.py), and in docs/architecture.md's "Moved" table.
MAP_TEST = ROOT / "tests" / "test_moved.py"
MOVED_TABLE = ("<!-- moved: begin -->", "<!-- moved: end -->")
CODE_DIRS = ("usp_hal", "backends", "tests", "benchmarks", "ci", "examples")


def _former():
    from usp_hal._moved import MOVED, SPLIT
    return sorted([*MOVED, *SPLIT], key=len, reverse=True)


def _former_patterns():
    """Regexes that find a former path in text: dotted (``pkg.mod``), as a file path
    (``pkg/mod.py``, ``pkg/mod/``), and imported by its parent (``from pkg import mod``)."""
    former = _former()
    dotted = "|".join(re.escape(f) for f in former)
    slashed = "|".join(re.escape(f.replace(".", "/")) for f in former)
    pats = [rf"(?<![\w.])(?:{dotted})(?![\w])", rf"(?<![\w./])(?:{slashed})(?:\.py\b|/)"]
    parents = {}
    for f in former:
        parent, _, leaf = f.rpartition(".")
        parents.setdefault(parent, []).append(leaf)
    for parent, leaves in parents.items():
        pats.append(rf"from {re.escape(parent)} import (?:[\w ,]*,\s*)?(?:{'|'.join(leaves)})\b")
    # a sub-package's own modules named relative to it (``integrations/trainer.py``)
    for f in former:
        parts = f.split(".")
        if len(parts) > 2:
            pats.append(rf"(?<![\w./]){re.escape('.'.join(parts[1:]))}(?![\w])")
            pats.append(rf"(?<![\w./]){re.escape('/'.join(parts[1:]))}\.py\b")
    return [re.compile(p) for p in pats]


def _former_imports(path: Path, package: str):
    """(line, module) of the imports of ``path`` (a module of ``package``, '' for a script) that
    resolve to a former path, relative imports included."""
    import ast
    former = set(_former())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if any(a.name == f or a.name.startswith(f + ".") for f in former)]
        elif isinstance(node, ast.ImportFrom):
            src = _source(node, package)
            if any(src == f or src.startswith(f + ".") for f in former):
                found.append((node.lineno, src))
            found += [(node.lineno, f"{src}.{a.name}") for a in node.names if f"{src}.{a.name}" in former]
    return found


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.parent.parts)
    if parts and parts[0] == "backends":
        parts = ["usp_hal", "backends", *parts[1:]]
    return ".".join(parts)


def _former_path_uses(text_files, code_files):
    """``file:line: text`` of every former path the given files name (the "Moved" table aside)."""
    pats = _former_patterns()
    found = []
    for path in text_files:
        text = path.read_text()
        lines = text.splitlines()
        inside = False
        for n, line in enumerate(lines, 1):
            if line.strip() == MOVED_TABLE[0]:
                inside = True
            elif line.strip() == MOVED_TABLE[1]:
                inside = False
            elif not inside and any(p.search(line) for p in pats):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    for path in code_files:
        found += [f"{path.relative_to(ROOT)}:{n}: imports {mod}" for n, mod in _former_imports(path, _package_of(path))]
    return sorted(set(found))


def _repository_files():
    code = sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
                  if not _is_former_path(p) and p != MAP_TEST and ".venv" not in p.parts)
    docs = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "ci").rglob("*.md"),
                   *(ROOT / "ci").rglob("*.sh"), *(ROOT / "ci").rglob("*.yml"), *(ROOT / "benchmarks").glob("*.sh"),
                   ROOT / "pyproject.toml", ROOT / "setup.py"])
    return code, docs


def test_the_repository_names_current_paths_only():
    code, docs = _repository_files()
    assert len(code) > 200 and ROOT / "docs" / "architecture.md" in docs
    found = _former_path_uses(code + docs, code)
    assert not found, ("former paths (use the current ones; the compat map, usp_hal/_moved/, lists them):\n"
                       + "\n".join(found))


def test_the_docs_have_one_moved_table_and_it_lists_every_former_path():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert text.count(MOVED_TABLE[0]) == 1 and text.count(MOVED_TABLE[1]) == 1
    table = text.split(MOVED_TABLE[0])[1].split(MOVED_TABLE[1])[0]
    from usp_hal._moved import MOVED, REMOVED_IN, SPLIT
    for former in [*MOVED, *SPLIT]:
        assert f"`{former}`" in table, former
    for new in MOVED.values():
        assert f"`{new}`" in table, new
    assert REMOVED_IN in table


def test_the_former_path_check_would_catch_each_form(tmp_path, monkeypatch):
    from usp_hal._moved import MOVED
    old = next(f for f in MOVED if f.count(".") == 1)          # a top-level former module
    sub = next(f for f in MOVED if f.count(".") == 2)          # a sub-package's former module
    parent, _, leaf = old.rpartition(".")
    samples = {"a.md": f"see `{old}.x`\n", "b.md": f"see {old.replace('.', '/')}.py\n",
               "c.md": f"from {parent} import attention, {leaf}\n", "d.md": f"`{sub.split('.', 1)[1]}`\n",
               "e.md": f"current: {MOVED[old]}\n"}
    code = tmp_path / "m.py"
    code.write_text(f"from {parent} import {leaf}\nimport {old} as x\nfrom {MOVED[old]} import y\n")
    paths = []
    for name, text in samples.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(text)
    assert [n for n, _ in _former_imports(code, "")] == [1, 2]
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = _former_path_uses(paths, [code])
    assert [f.split(":")[0] for f in found] == ["a.md", "b.md", "c.md", "d.md", "m.py", "m.py"], found
