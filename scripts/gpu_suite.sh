#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, one step per command, each cut at 9 minutes (one command may run
# 10 minutes on the device machines). The first session of 15 minutes runs scripts/gpu_first_session.sh
# instead (every step below but bench, under one budget); this script serves the second session (bench) and
# sessions that follow up on one step (docs/BENCHMARKS.md has the plan):
#
#   scripts/gpu_suite.sh probe   # does this torch behave as the CUDA backend assumes? (gpu_probe.py)
#   scripts/gpu_suite.sh core    # the CUDA backend's cuda-marked tests (first-run items, pools, memory, predictions)
#   scripts/gpu_suite.sh pools   # graph-pool life over many steps (gpu_checks.py, a process per check)
#   scripts/gpu_suite.sh rest    # every other cuda-marked test but NCCL's
#   scripts/gpu_suite.sh nccl    # lockstep on a 1-rank NCCL group (docs/DISTRIBUTED.md)
#   scripts/gpu_suite.sh bench   # the benchmark on the tiny and realistic models, without torch.compile
#   scripts/gpu_suite.sh all     # every step in order, in one command (a machine without that limit)
#
# Each step writes machine.txt and <step>.log (bench: also two JSON and two PNG) to ${OUT:-gpu_out}
# and exits non-zero when something in it failed.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
STEP_LIMIT=540
CORE_TESTS=(tests/test_cuda_first_run.py tests/test_cuda_pool.py tests/test_capture_memory.py
            tests/test_cuda_predictions.py tests/test_gpu_probe.py)
NCCL_TEST=tests/test_lockstep_agreement.py::test_one_rank_nccl_group_captures_the_models_all_reduce_in_the_graph

machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
}

step() {
  case "$1" in
    probe) python3 scripts/gpu_probe.py ;;
    core) python3 -m pytest -m cuda -q -rs -p no:cacheprovider "${CORE_TESTS[@]}" ;;
    pools) python3 scripts/gpu_checks.py ;;
    rest)
      deselect=()
      for file in "${CORE_TESTS[@]}"; do deselect+=(--ignore "$file"); done
      python3 -m pytest -m cuda -q -rs -p no:cacheprovider "${deselect[@]}" --deselect "$NCCL_TEST" ;;
    nccl)
      python3 -c "import torch, torch.cuda.nccl, torch.distributed as dist; print('nccl', torch.cuda.nccl.version() if dist.is_nccl_available() else None)"
      NCCL_DEBUG=WARN python3 -m pytest -q -rA -p no:cacheprovider "$NCCL_TEST" ;;
    bench)
      status=0
      for model in tiny realistic; do
        python3 scripts/bench.py --model "$model" --no-compile --out "$out" 2>&1 | grep -v "it/s]" || status=1
      done
      return $status ;;
    *) echo "unknown step '$1': probe, core, pools, rest, nccl, bench or all" >&2; return 2 ;;
  esac
}

if [ "${1:-}" = --one ]; then  # one step, in the process the loop below cuts at STEP_LIMIT
  step "$2"
  exit $?
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && { echo "usage: scripts/gpu_suite.sh probe|core|pools|rest|nccl|bench|all" >&2; exit 2; }
[ "${steps[0]}" = all ] && steps=(probe core pools rest nccl bench)
machine 2>&1 | tee "$out/machine.txt"
failed=0
for name in "${steps[@]}"; do
  timeout "$STEP_LIMIT" bash "$self" --one "$name" 2>&1 | tee "$out/$name.log"
  code=${PIPESTATUS[0]}
  [ "$code" -eq 124 ] && echo "step $name: cut at $STEP_LIMIT s" | tee -a "$out/$name.log"
  [ "$code" -ne 0 ] && failed=1
done
exit $failed
