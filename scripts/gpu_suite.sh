#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one command (for the device tool's `run`, or any CUDA box):
# the cuda-marked tests, the graph-pool checks (scripts/gpu_checks.py: each in a process of its own,
# one JSON line each, appended to the test log), then the benchmark on the tiny and realistic models.
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
python3 -m pytest -m cuda -q -rs -p no:cacheprovider 2>&1 | tee "$out/pytest_cuda.log"
python3 scripts/gpu_checks.py 2>&1 | tee -a "$out/pytest_cuda.log"
for model in tiny realistic; do
  python3 scripts/bench.py --model "$model" --out "$out" 2>&1 | grep -v "it/s]" | tee "$out/bench_$model.log"
done
