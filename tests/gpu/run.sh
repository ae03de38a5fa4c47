#!/usr/bin/env bash
# The GPU check (tests/gpu/gpu_check.py): prints one JSON line. On a GPU machine: `tests/gpu/run.sh`
# (no network, no Redis, no install: torch, transformers and numpy are enough). On any machine:
# `tests/gpu/run.sh --dry-run` runs the same code on the CPU with tiny shapes (CI does, so it cannot rot).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" -m tests.gpu.gpu_check "$@"
