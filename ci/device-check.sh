#!/usr/bin/env bash
# The first-GPU device check: everything usp-hal can prove on one CUDA machine in minutes.
#
#   ci/device-check.sh OUTDIR [--dry-run]
#
# Needs no network.  Steps (each one's outcome goes to OUTDIR/steps.tsv and into the report):
#   install   pip install --no-deps -e . over the machine's torch (--no-build-isolation first:
#             no index is needed when setuptools is there); then sageattention 1.0.6 from the
#             wheel in ci/wheels/ (pure Python, 20 KB, carried in the tree) when it is missing
#   probe     usp-hal probe (text and JSON)
#   matrix    usp-hal matrix --device cuda-sm90 (JSON and markdown; declarations only)
#   checks    python ci/device_check.py: real kernels vs float64, several ranks on
#             the one GPU, no hidden syncs, CUDA graphs, timings (list them: --list)
#   verify    usp-hal probe --verify for sdpa and sage_fp8, each in its own process, with the time left
# OUTDIR gets device-check.json and device-check.txt (the table), plus each step's output.
#
# --dry-run: the same script on the CPU (what CI runs): installs nothing, prints every check
# that needs CUDA by name as skipped, runs the others with CPU tensors; verify runs sdpa only.
# Environment: PYTHON (default python), USP_HAL_DEVICE_CHECK_BUDGET (seconds, default 470).
set -uo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 1 ]] || usage
case "$1" in -h|--help) usage ;; esac
OUT=$1
shift
DRY=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=--dry-run ;;
        *) echo "unknown argument '$arg'" >&2; usage ;;
    esac
done

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
BUDGET=${USP_HAL_DEVICE_CHECK_BUDGET:-470}
START=$SECONDS
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.tsv"

log() { printf '\n== device-check: %s (%d s)\n' "$*" "$((SECONDS - START))"; }
step() {   # step NAME STATUS DETAIL
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT/steps.tsv"
    printf '%-5s step/%s: %s\n' "$(echo "$2" | tr a-z A-Z)" "$1" "$3"
}

# ---- install
if [[ -n "$DRY" ]]; then
    step install skip "--dry-run: the environment is left as it is"
else
    log "install"
    if "$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
        || "$PY" -m pip install --no-deps -e . >> "$OUT/install.log" 2>&1; then
        step install pass "pip install --no-deps -e . over torch $("$PY" -c 'import torch; print(torch.__version__)')"
    else
        step install fail "pip install --no-deps -e . failed (see install.log)"
    fi
    if ! "$PY" -c "import sageattention" 2>/dev/null; then
        wheel=$(ls ci/wheels/sageattention-1.0.6-*.whl 2>/dev/null | head -1)
        if [[ -n "$wheel" ]] && "$PY" -m pip install --no-deps --no-index "$wheel" >> "$OUT/install.log" 2>&1; then
            step install-sage pass "sageattention 1.0.6 from $wheel"
        else
            step install-sage fail "sageattention 1.0.6 could not be installed from ci/wheels (see install.log)"
        fi
    else
        step install-sage pass "sageattention $("$PY" -c 'import importlib.metadata as m; print(m.version("sageattention"))') already installed"
    fi
    # fla 0.6.0 (pure Python, about 1.5 MB together): its wheels are not carried in the tree; put them
    # in ci/wheels (pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0) to run
    # the fla state-passing checks on the real Triton kernels, else those checks skip by name
    if ! "$PY" -c "import fla" 2>/dev/null; then
        fla_wheels=$(ls ci/wheels/fla_core-0.6.0-*.whl ci/wheels/flash_linear_attention-0.6.0-*.whl 2>/dev/null)
        if [[ -n "$fla_wheels" ]] && "$PY" -m pip install --no-deps --no-index $fla_wheels >> "$OUT/install.log" 2>&1; then
            step install-fla pass "fla 0.6.0 from ci/wheels"
        else
            step install-fla skip "fla 0.6.0 not in ci/wheels: the fla checks skip"
        fi
    fi
fi
# ---- probe and matrix: the four commands in one process (each start of Python with torch costs
# seconds of the budget); each writes its file as `usp-hal probe > probe.txt 2>&1`, `usp-hal probe
# --json > probe.json`, and the two `usp-hal matrix` do; the process prints which of them passed
log "probe"
cli_ok=$("$PY" - "$OUT" <<'PYEOF'
import contextlib, os, sys, traceback
try:
    import usp_hal.backends  # noqa: F401
except Exception:
    sys.exit(3)
from usp_hal.cli import main
out = sys.argv[1]
with open(os.devnull, "w") as devnull:
    for name, path, argv, err in (
            ("probe", "probe.txt", ["probe"], "file"),
            ("probe-json", "probe.json", ["probe", "--json"], devnull),
            ("matrix", "matrix-cuda-sm90.json", ["matrix", "--device", "cuda-sm90"], sys.stderr),
            ("matrix-md", "matrix-cuda-sm90.md", ["matrix", "--device", "cuda-sm90", "--format", "markdown"],
             sys.stderr)):
        with open(os.path.join(out, path), "w") as f, contextlib.redirect_stdout(f), \
                contextlib.redirect_stderr(f if err == "file" else err):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code
            except Exception:
                traceback.print_exc()
                rc = 1
        if not rc:
            print(name)
PYEOF
)
if [[ $? -eq 3 ]]; then
    echo "usp_hal cannot be imported after the install step; see $OUT/install.log" >&2
    exit 1
fi
has() { [[ " $(echo $cli_ok) " == *" $1 "* ]]; }
if has probe && has probe-json; then
    step probe pass "probe.txt, probe.json"
else
    step probe fail "usp-hal probe failed (probe.txt)"
fi
cat "$OUT/probe.txt"
log "matrix"
if has matrix && has matrix-md; then
    step matrix pass "$("$PY" -c "import json,sys; print(len(json.load(open(sys.argv[1]))), 'entries for cuda-sm90')" "$OUT/matrix-cuda-sm90.json")"
else
    step matrix fail "usp-hal matrix --device cuda-sm90 failed"
fi

# ---- the checks
log "checks"
left=$((BUDGET - (SECONDS - START)))
# 90 s stay for probe --verify; the checks write their report after each one, so a cut run keeps what finished
timeout --kill-after=10 "$((left > 150 ? left - 90 : 60))" "$PY" ci/device_check.py "$OUT" $DRY --no-summary
rc=$?
[[ $rc -eq 124 || $rc -eq 137 ]] && step checks fail "the checks ran out of time (see device-check.json for those that finished)"

# ---- probe --verify with the time left
log "probe --verify"
left=$((BUDGET - (SECONDS - START)))
if [[ -n "$DRY" ]]; then
    verify_args=(--backend sdpa --dtype fp32)
else
    verify_args=(--backend sdpa --backend sage_fp8)   # flex: compiled per structure, checked above
fi
if [[ $left -lt 30 ]]; then
    step probe-verify skip "no time left (${left} s)"
else
    per=$((left - 10 < 150 ? left - 10 : 150))
    timeout --kill-after=10 "$((left - 5))" "$PY" -m usp_hal probe --verify "${verify_args[@]}" --timeout "$per" --json \
        > "$OUT/verify.json" 2> "$OUT/verify.err"
    vrc=$?
    summary=$("$PY" -c "
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except Exception as exc:
    print('no report:', exc); sys.exit(0)
print('; '.join(r['backend'] + ' ' + r['status'] for r in rep['summary']))" "$OUT/verify.json")
    if [[ $vrc -eq 0 ]]; then step probe-verify pass "$summary"; else step probe-verify fail "rc $vrc: $summary"; fi
fi

# ---- one report
"$PY" ci/device_check.py "$OUT" --merge-steps "$OUT/steps.tsv"
