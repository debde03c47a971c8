#!/usr/bin/env bash
# Every training engine docs/engines.md names, at the versions the engine tests use, into the Python
# environment of `python` (or $PYTHON), after the README's first command (torch==2.13.0 and the
# project installed):
#
#     bash ci/install-engines.sh
#
# 1. The `engines` extra (pyproject.toml), with its dependencies: trl 1.16.0 (it brings datasets,
#    pandas, pyarrow), tyro and spmd_types (what torchtitan's model and parallelize code import),
#    fla 0.6.0 (fla-core, flash-linear-attention), triton 3.8.0 (torchtitan's parallelize code,
#    DeepSpeed's ZeRO engine and fla import it) and the four packages deepspeed needs beyond the
#    test extra's.  None of them asks for torch.
# 2. --no-deps, as each asks for an unpinned torch (pip could replace the CPU build by a CUDA one of
#    several GB) or for its trainer's own stack:
#    - torchtitan 0.3.0: its declared dependencies (torchdata, wandb, tensorboard, ...) are for its
#      trainer, not the model and parallelize code the recipes run;
#    - deepspeed 0.19.8 (an sdist; DS_BUILD_OPS=0: no CUDA op is built, its CPU accelerator
#      JIT-builds its shm comm op with ninja on first use);
#    - yunchang 0.6.4 (the peer usp-hal is a drop-in for; it imports on the CPU, with or without
#      flash_attn).
#    xfuser is not installed: `import xfuser` (0.7.0) raises NotImplementedError("No Accelerators
#    ...") on a machine without a GPU (xfuser/envs.py, get_device_version), so nothing can run it
#    here; the yunchang alias is checked against the imports xfuser makes
#    (tests/data/xfuser_0.7.0_yunchang_imports.txt) and xDiT-style code
#    (examples/engines/yunchang_alias.py).
# The torch build is checked to be the one found before.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"

before="$("$py" -c 'import torch; print(torch.__version__)')"
"$py" -m pip install --quiet -e '.[engines]'
"$py" -m pip install --quiet --no-deps torchtitan==0.3.0 yunchang==0.6.4
DS_BUILD_OPS=0 "$py" -m pip install --quiet --no-deps deepspeed==0.19.8
after="$("$py" -c 'import torch; print(torch.__version__)')"
if [ "$before" != "$after" ]; then
  echo "ci/install-engines.sh: torch changed from $before to $after" >&2
  exit 1
fi
"$py" - <<'PY'
import importlib.metadata as md
names = ["trl", "tyro", "spmd_types", "fla-core", "flash-linear-attention", "triton", "torchtitan", "deepspeed",
         "yunchang"]
print("engines:", ", ".join(f"{n} {md.version(n)}" for n in names))
PY
