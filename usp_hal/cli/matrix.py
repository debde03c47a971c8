"""``usp-hal matrix``: per-device CI matrices and the backend docs table, from the declarations.

The matrices and the page come from :mod:`usp_hal.harness.matrix`; this module parses the
arguments and prints.  Formats: ``json`` (default; a list usable as a GitHub Actions
``strategy.matrix.include``), ``markdown``, and ``extras`` (the pip extras that install the
profile's kernel packages).  ``--docs [PATH]`` writes ``docs/backends.md``; ``--docs
--check`` only compares.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..harness.matrix import (
    DOCS_COMMAND,
    DOCS_PATH,
    PROFILES,
    generate_docs,
    get_profile,
    installed_kernel_packages,
    matrix_entries,
    matrix_markdown,
    profile_extras,
    source_built_backends,
)


# ----------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "matrix", help="generate CI matrices and the backend docs table from the declarations",
        description="Per-device CI matrices generated from the backend declarations "
                    f"(profiles: {', '.join(PROFILES)}).")
    p.add_argument("--device", default="all", metavar="PROFILE",
                   help=f"one profile ({', '.join(PROFILES)}), 'auto' for this machine, or 'all' (default)")
    p.add_argument("--format", choices=("json", "markdown", "extras", "source-built"), default="json",
                   help="json: a GitHub Actions matrix include list (default); markdown: tables; "
                        "extras: the pip extras of the profile's backends that install from wheels, "
                        "comma-separated (with --all-extras: every extra); source-built: the profile's "
                        "backends whose kernel package needs a source build")
    p.add_argument("--all-extras", action="store_true",
                   help="with --format extras: include extras whose package builds from source (slow)")
    p.add_argument("--docs", nargs="?", const=DOCS_PATH, metavar="PATH",
                   help=f"write the backend docs page (default path: {DOCS_PATH})")
    p.add_argument("--check", action="store_true",
                   help="with --docs: do not write; exit 1 if the file differs from a fresh generation")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        if args.docs:
            return _run_docs(Path(args.docs), args.check)
        if args.check:
            print("usp-hal matrix: --check only applies with --docs", file=sys.stderr)
            return 2
        profiles = list(PROFILES.values()) if args.device == "all" else [get_profile(args.device)]
        if args.format == "markdown":
            sys.stdout.write(matrix_markdown(profiles))
            return 0
        entries = [e for p in profiles for e in matrix_entries(p)]
        if args.format == "extras":
            print(",".join(profile_extras(entries, wheels_only=not args.all_extras)))
        elif args.format == "source-built":
            print(",".join(source_built_backends(entries)))
        else:
            print(json.dumps(entries, indent=2))
        return 0
    except (ValueError, RuntimeError) as exc:
        print(f"usp-hal matrix: {exc}", file=sys.stderr)
        return 2


def _run_docs(path: Path, check: bool) -> int:
    text = generate_docs()
    present = installed_kernel_packages()
    if present:
        print(f"warning: kernel packages are installed here ({', '.join(present)}); version-dependent "
              f"rules may make this differ from the page generated without them", file=sys.stderr)
    if check:
        current = path.read_text() if path.exists() else None
        if current != text:
            print(f"{path} is stale: run `{DOCS_COMMAND}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0
