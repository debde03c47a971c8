"""usp-hal command line: probe, run, bench, matrix, plan, calibrate."""
from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module in this package that defines add_parser(subparsers) and run(args)
COMMANDS = {
    "probe": "probe",
    "run": "run",
    "bench": "bench",
    "matrix": "matrix",
    "plan": "plan",
    "calibrate": "calibrate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="usp-hal", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for modname in COMMANDS.values():
        try:
            mod = importlib.import_module(f"{__name__}.{modname}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{modname}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`usp-hal plan --json | head`): stop quietly; point stdout at
        # devnull so the interpreter's final flush does not raise again
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
