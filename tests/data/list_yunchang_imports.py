"""Lists the ``yunchang`` imports of a package's source, one ``module name`` pair a line.

Made for tests/data/xfuser_0.7.0_yunchang_imports.txt:

    pip download --no-deps xfuser==0.7.0 -d /tmp/x && unzip -q /tmp/x/xfuser-0.7.0-py3-none-any.whl -d /tmp/x/src
    python tests/data/list_yunchang_imports.py /tmp/x/src/xfuser xfuser==0.7.0 \
        > tests/data/xfuser_0.7.0_yunchang_imports.txt

Every ``import yunchang...`` and ``from yunchang... import name`` statement in every ``.py`` file
(at any depth: guarded and function-level imports included) is read with :mod:`ast`; a pair is
listed once, with the files that import it."""
import ast
import sys
from collections import defaultdict
from pathlib import Path


def main(root: str, label: str) -> None:
    seen = defaultdict(set)
    base = Path(root)
    for path in sorted(base.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        where = f"{base.name}/{path.relative_to(base).as_posix()}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "yunchang":
                for alias in node.names:
                    seen[(node.module, alias.name)].add(where)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "yunchang":
                        seen[(alias.name, "")].add(where)
    print(f"# the yunchang imports of {label}, made by tests/data/list_yunchang_imports.py (see its docstring)")
    print("# module name  # importing files")
    for (module, name), files in sorted(seen.items()):
        print(f"{module} {name or '-'}  # {' '.join(sorted(files))}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
