"""Check an installed usp-hal against the source tree it was built from.

``python -m usp_hal.harness.installed SOURCE_ROOT`` (run from outside the tree, see
``ci/wheel-check.sh``): every module of the tree exists in the installed package and imports,
every public name resolves and is listed by ``dir(usp_hal)``, the data files are there, and
nothing is imported from the tree itself.  A module that needs a package outside the
declared dependencies (an extra) that is not installed is reported, not failed.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def required_modules() -> set:
    """What a module may never be missing: the package itself and the dependencies its installed
    metadata declares outside any extra (import names taken as the distribution names); any
    other missing module belongs to an extra ([hf], [bench], a kernel package)."""
    import importlib.metadata
    import re
    deps = importlib.metadata.requires("usp-hal") or []
    return {"usp_hal"} | {re.split(r"[\s;<>=!~\[(]", d, maxsplit=1)[0].replace("-", "_").lower()
                          for d in deps if "extra ==" not in d}


def tree_modules(root: Path) -> list[str]:
    """Dotted names of every module in the source tree, as the wheel should install them."""
    names = []
    for pkg_dir, prefix in ((root / "usp_hal", "usp_hal"), (root / "backends", "usp_hal.backends")):
        for path in sorted(pkg_dir.rglob("*.py")):
            rel = path.relative_to(pkg_dir).with_suffix("")
            if prefix == "usp_hal" and rel.parts[0] == "backends":   # a local link to backends/, not a package
                continue
            if rel.name == "__main__":                           # runs the CLI when imported
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join([prefix, *parts]))
    return names


def check(root: Path) -> list[str]:
    problems, skipped = [], []
    required = required_modules()
    spec = importlib.util.find_spec("usp_hal")
    home = Path(spec.origin if spec and spec.origin else "").resolve().parent
    if root == home or root in home.parents:
        return [f"usp_hal resolves to the source tree ({home}): run from outside it, in an environment with the "
                "package installed"]
    for name in tree_modules(root):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if top and top not in required:
                skipped.append(f"{name} (needs {top})")
                continue
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - every failure is a finding here
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        where = Path(getattr(mod, "__file__", "") or "").resolve()
        if home not in where.parents:
            problems.append(f"{name} was imported from {where}, outside the installed package {home} "
                            "(left out of the wheel, and found elsewhere on the path)")
    import usp_hal

    listed = set(dir(usp_hal))
    for name in usp_hal.__all__:
        try:
            getattr(usp_hal, name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"usp_hal.{name}: {type(exc).__name__}: {exc}")
        if name not in listed:
            problems.append(f"usp_hal.{name} is public but missing from dir(usp_hal)")
    data = Path(usp_hal.__file__).parent / "profiles"
    if not sorted(data.glob("*.json")):
        problems.append(f"no planner profiles installed in {data}")
    print(f"installed usp-hal: {len(tree_modules(root)) - len(skipped)} modules imported, "
          f"{len(usp_hal.__all__)} public names resolved")
    for s in skipped:
        print(f"  not imported, optional dependency missing: {s}")
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m usp_hal.harness.installed SOURCE_ROOT", file=sys.stderr)
        return 2
    problems = check(Path(argv[0]).resolve())
    for p in problems:
        print("FAIL", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
