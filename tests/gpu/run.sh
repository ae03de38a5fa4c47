#!/usr/bin/env bash
# The GPU check (tests/gpu/gpu_check.py): prints one JSON line. On a GPU machine: `tests/gpu/run.sh`
# (no network, no Redis, no install: torch, transformers and numpy are enough). On any machine:
# `tests/gpu/run.sh --dry-run` runs the same code on the CPU with tiny shapes (CI does, so it cannot rot), the
# triton attention kernel in Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ " $* " == *" --dry-run "* ]]; then
  export TRITON_INTERPRET=1
fi
exec "${PYTHON:-python3}" -m tests.gpu.gpu_check "$@"
