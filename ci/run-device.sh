#!/usr/bin/env bash
# Run the usp-hal CI for one device profile.
#
#   ci/run-device.sh PROFILE [STEP ...]
#
# PROFILE is one of `usp-hal matrix` profiles: cpu, cuda-sm80, cuda-sm90, rocm, npu, xpu.
# STEPS (default: probe test):
#   install  install the device's torch (only when TORCH_SPEC or TORCH_INDEX_URL is set;
#            otherwise the torch already on the runner is kept), then usp-hal with its
#            [test] extra and the extras of the profile's backends that pip installs from
#            wheels (USP_HAL_ALL_EXTRAS=1: also those that build from source, e.g. flash-attn);
#            flashinfer only where its JIT has a compiler (nvcc) or flashinfer-jit-cache
#   probe    check the machine matches PROFILE, print `usp-hal probe`, save it as JSON,
#            then `usp-hal probe --verify`: every available backend vs the float64 reference,
#            each in its own process for at most USP_HAL_VERIFY_TIMEOUT seconds (default 240),
#            ending with one line per backend: verified, refused (why), unavailable (why),
#            failed or timeout
#   test     write the profile's matrix (`usp-hal matrix --device PROFILE`) and run pytest
#            with it (USP_HAL_MATRIX): one verification per matrix entry plus the whole suite
#
# Environment: PYTHON (default python), TORCH_SPEC (e.g. "torch==2.13.0"), TORCH_INDEX_URL
# (the wheel index of the device's torch build), USP_HAL_CI_OUT (default ci/out/PROFILE),
# USP_HAL_MATRIX_OPTIONAL (backends this runner may lack; their entries are skipped, not
# failed; default when unset: the profile's backends whose package builds from source, plus
# flashinfer where no compiler is found), PYTEST_ADDOPTS (extra pytest options).
set -euo pipefail

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 1 ]] || usage
case "$1" in -h|--help) usage ;; esac

PROFILE=$1
shift
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(probe test)

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${USP_HAL_CI_OUT:-ci/out/$PROFILE}

log() { printf '\n== %s: %s\n' "$PROFILE" "$*"; }

# refuse a profile name the matrix does not know (needs usp-hal importable)
check_profile() {
    "$PY" - "$PROFILE" <<'PY'
import sys
from usp_hal.harness.matrix import get_profile
try:
    get_profile(sys.argv[1])
except ValueError as exc:
    sys.exit(f"ci/run-device.sh: {exc}")
PY
}

# FlashInfer compiles its kernels on first use: it needs nvcc, or flashinfer-jit-cache
jit_compiler_present() {
    command -v nvcc >/dev/null 2>&1 && return 0
    local home=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
    [[ -x "$home/bin/nvcc" ]] && return 0
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('flashinfer_jit_cache') is None)" 2>/dev/null
}

optional_backends() {
    if [[ -n "${USP_HAL_MATRIX_OPTIONAL+set}" ]]; then
        echo "$USP_HAL_MATRIX_OPTIONAL"
        return
    fi
    local opt
    opt=$("$PY" -m usp_hal matrix --device "$PROFILE" --format source-built)
    if ! jit_compiler_present; then
        opt="${opt:+$opt,}flashinfer"
    fi
    echo "$opt"
}

step_install() {
    if [[ -n "${TORCH_SPEC:-}" || -n "${TORCH_INDEX_URL:-}" ]]; then
        log "installing ${TORCH_SPEC:-torch}${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
        "$PY" -m pip install "${TORCH_SPEC:-torch}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    else
        log "keeping the runner's torch"
        "$PY" -c "import torch; print('torch', torch.__version__)"
    fi
    log "installing usp-hal[test]"
    "$PY" -m pip install -e ".[test]"
    check_profile
    local extras
    extras=$("$PY" -m usp_hal matrix --device "$PROFILE" --format extras ${USP_HAL_ALL_EXTRAS:+--all-extras})
    if [[ ",$extras," == *",flashinfer,"* ]] && ! jit_compiler_present; then
        log "skipping flashinfer: no nvcc and no flashinfer-jit-cache for its first-use kernel compilation"
        extras=$(echo ",$extras," | sed 's/,flashinfer,/,/; s/^,//; s/,$//')
    fi
    if [[ -n "$extras" ]]; then
        log "installing usp-hal[test,$extras]"
        "$PY" -m pip install -e ".[test,$extras]"
    fi
}

step_probe() {
    check_profile
    mkdir -p "$OUT"
    if [[ "$PROFILE" != cpu ]]; then
        local here
        here=$("$PY" -c "from usp_hal.harness.matrix import machine_profile; print(machine_profile().name)") || here="none"
        if [[ "$here" != "$PROFILE" ]]; then
            echo "this runner is labelled $PROFILE but torch sees a $here machine; check the runner and its torch build" >&2
            exit 1
        fi
    fi
    log "probe"
    "$PY" -m usp_hal probe
    "$PY" -m usp_hal probe --json > "$OUT/probe.json"
    log "probe --verify"
    "$PY" -m usp_hal probe --verify --timeout "${USP_HAL_VERIFY_TIMEOUT:-240}" --json > "$OUT/verify.json" || true
    "$PY" - "$OUT/verify.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print("per backend:")
for row in report["summary"]:
    print(f"  {row['backend']:<11} {row['status']}" + (f": {row['detail']}" if row["detail"] else ""))
sys.exit(0 if report["verify"]["ok"] else 1)
PY
}

step_test() {
    check_profile
    mkdir -p "$OUT"
    log "matrix"
    "$PY" -m usp_hal matrix --device "$PROFILE" > "$OUT/matrix.json"
    "$PY" -m usp_hal matrix --device "$PROFILE" --format markdown
    log "pytest"
    local optional
    optional=$(optional_backends)
    log "backends this runner may lack: ${optional:-none}"
    USP_HAL_MATRIX_OPTIONAL="$optional" USP_HAL_MATRIX="$OUT/matrix.json" \
        "$PY" -m pytest tests -q -p no:cacheprovider --junitxml="$OUT/junit.xml"
}

for step in "${STEPS[@]}"; do
    case "$step" in
        install) step_install ;;
        probe) step_probe ;;
        test) step_test ;;
        *) echo "unknown step '$step' (install, probe, test)" >&2; exit 2 ;;
    esac
done
