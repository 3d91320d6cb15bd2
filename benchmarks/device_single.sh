#!/usr/bin/env bash
# Issue #3's GPU checks: the CUDA tests, then benchmarks/single_device.py on the GPU (GPT-2
# small and medium shapes). 8-bit AdamW on CUDA needs bitsandbytes: put its wheel in .whl/.
set -uo pipefail
out=${OUT:-runs/device}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_cuda.py -k "loader or fp16" 2>&1 | tail -3
timeout 380 python3 benchmarks/single_device.py --sizes gpt2,gpt2-medium --warmup 2 --steps 4 \
    2>&1 | grep -v -i "warn" | tee "$out/single_device.log"
cp benchmarks/results/single_device_cuda.* "$out/" 2>/dev/null
