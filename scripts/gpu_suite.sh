#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one command (for the device tool's `run`, or any CUDA box):
# the cuda-marked tests (lockstep on a 1-rank NCCL group run on its own, verbosely), the graph-pool
# checks (scripts/gpu_checks.py: each in a process of its own, one JSON line each, appended to the
# test log), then the benchmark on the tiny and realistic reference models.
# Writes at most 8 files to ${OUT:-gpu_out}: machine, test log, two bench logs, two JSON, two PNG.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/machine.txt"
# Lockstep on NCCL runs below on its own, verbosely; every other cuda-marked test here.
nccl_test=tests/test_lockstep_agreement.py::test_one_rank_nccl_group_captures_the_models_all_reduce_in_the_graph
python3 -m pytest -m cuda -q -rs -p no:cacheprovider --deselect "$nccl_test" 2>&1 | tee "$out/pytest_cuda.log"
# Lockstep on NCCL (docs/DISTRIBUTED.md): a 1-rank NCCL group (its own child process) whose model's
# all-reduce is captured inside every graph, agreements on a gloo group, no host sync per step.
# Appended to the cuda test log, after the NCCL version (NCCL_DEBUG=WARN: NCCL's own complaints).
{
  python3 -c "import torch, torch.cuda.nccl, torch.distributed as dist; print('nccl', torch.cuda.nccl.version() if dist.is_nccl_available() else None)"
  NCCL_DEBUG=WARN python3 -m pytest -q -rA -p no:cacheprovider "$nccl_test"
} 2>&1 | tee -a "$out/pytest_cuda.log"
python3 scripts/gpu_checks.py 2>&1 | tee -a "$out/pytest_cuda.log"
for model in tiny realistic; do
  python3 scripts/bench.py --model "$model" --out "$out" 2>&1 | grep -v "it/s]" | tee "$out/bench_$model.log"
done
