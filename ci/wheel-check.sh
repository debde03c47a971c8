#!/usr/bin/env bash
# What a user installs: build an sdist and a wheel from the tree (the wheel is built from the
# sdist, so a file the sdist leaves out is missing from the wheel too), install the wheel, not
# editable, into a fresh virtual environment with no source tree on the path, import every module
# of the installed package, and run `usp-hal probe` and `usp-hal run` from it.
#
#   bash ci/wheel-check.sh              the venv sees the base interpreter's packages (its torch)
#   bash ci/wheel-check.sh --isolated   a venv of its own, torch==2.13.0 installed into it
#
# Sharing the base interpreter's torch saves installing it again; the base may also hold an
# editable install of this tree, so the check fails any module that resolves to the source tree
# instead of the installed package (a module left out of the wheel would do exactly that).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
isolated=0
[ "${1:-}" = "--isolated" ] && isolated=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python -m build --no-isolation --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
ls "$work/dist"
py="$work/venv/bin/python"
if [ "$isolated" = 1 ]; then
  python -m venv "$work/venv"
  "$py" -m pip install --quiet torch==2.13.0
else
  python -m venv --system-site-packages "$work/venv"
fi
"$py" -m pip install --quiet "$work"/dist/*.whl     # its declared dependencies must resolve too

cd "$work"                                   # no source tree on the path
"$py" -m usp_hal.harness.installed "$root"
"$work/venv/bin/usp-hal" probe >"$work/probe.txt" || { cat "$work/probe.txt"; exit 1; }
head -5 "$work/probe.txt"
"$work/venv/bin/usp-hal" run --nproc 2 --seqlen 256 --heads 4 --head-dim 32 --bwd
echo "wheel check: passed"
