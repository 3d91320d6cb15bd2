#!/usr/bin/env bash
# One device call for the CUDA paths: the CUDA tests, then benchmarks/cuda_paths.py (each
# path of `meshfit train` on CUDA beside the CPU). About 3 minutes on an H100/H200.
set -uo pipefail
out=${OUT:-runs/device}
mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -o addopts=-ra -q -p no:cacheprovider tests/distributed/test_cuda.py 2>&1 \
    | tail -15 | tee "$out/test_cuda.log"
timeout 240 python3 benchmarks/cuda_paths.py --runs /tmp/cuda_paths 2>&1 \
    | grep -v -i "warn" | tee "$out/cuda_paths.log"
cp benchmarks/results/cuda_paths.json "$out/" 2>/dev/null
