#!/usr/bin/env bash
# GPU check, for a machine with one CUDA GPU (under 5 minutes in all):
#   1. the kernel tests with the Triton kernels compiled for the GPU (not the interpreter), against their torch
#      references;
#   2. the TTFT benchmark with the large Jamba-shaped model (~520M parameters) in bf16, printed as one table
#      (no cache / miss / hit / suffix-only lower bound, restore steps, scan alone).
# Needs torch with CUDA, triton, transformers 5.23 and pytest installed; it installs nothing (no network needed).
# Usage, from anywhere: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET # compiled kernels; tests/conftest.py only turns the interpreter on without CUDA

python - <<'EOF'
import importlib.util
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh needs a CUDA GPU: torch.cuda.is_available() is False.")
missing = [name for name in ("triton", "transformers", "pytest") if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu_check.sh needs {', '.join(missing)} installed.")
import transformers
import triton

print(
    f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
    f"triton {triton.__version__} | transformers {transformers.__version__}"
)
for name in ("mamba_ssm", "causal_conv1d", "fla"):
    found = importlib.util.find_spec(name) is not None
    print(f"{name}: {'installed (stock transformers uses it)' if found else 'not installed'}")
EOF

echo "== 1. kernel tests on the GPU =="
timeout 110 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_triton.py tests/test_gated_delta.py tests/test_kda.py

echo "== 2. TTFT benchmark, large model, bf16 =="
timeout 170 python benchmarks/ttft.py --device cuda --size large --dtype bfloat16 --repeats 3
