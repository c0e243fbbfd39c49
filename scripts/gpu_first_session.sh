#!/usr/bin/env bash
# The first GPU session in one call (issue 40): versions, probes, the last rounds' fixes, pool checks, a
# Hugging Face smoke, the engine's rows, NCCL lockstep, the other cuda tests, in that order, under one 9-minute
# budget (each step capped; one that would overrun is skipped and named). No make, no pip: the image's python3 and torch.
#
#   scripts/gpu_first_session.sh              # summary.txt and up to six step files in ${OUT:-gpu_out}
#   GPU_SESSION_BUDGET_S=300 scripts/gpu_first_session.sh
#
# The steps, caps and files: scripts/gpu_session.py; the plan of a 15-minute session: docs/BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" scripts/gpu_session.py "$@"
