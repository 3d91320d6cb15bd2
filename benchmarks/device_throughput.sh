#!/usr/bin/env bash
# One device call for the GPU throughput figures: `meshfit train`'s tokens/s, MFU and peak
# memory for GPT-2 124M (seq 1024, micro-batches 16 and 32) and llama-1b (seq 2048, micro 8)
# in bf16 + TF32 + compile, each model's best micro-batch again with float8 linears
# (torchao's rowwise recipe), and GPT-2's fp32-vs-fast loss check after the same 100 steps.
# torchao is not in the GPU image: put its wheel in .whl/ (carried). Results and logs to $OUT.
# About 6-7 minutes on an H100/H200 (compilation included).
set -uo pipefail
out=${OUT:-runs/device}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)" \
    2>&1 | grep -v "Failed to load" | tee -a "$out/gpu.txt"
timeout 230 python3 benchmarks/throughput.py --models gpt2 --micro 16,32 --seq-len 1024 \
    --steps 30 --float8 --loss-check 100 --breakdown-steps 0 --name throughput_cuda_gpt2 \
    --runs /tmp/runs 2>&1 | grep -v -i "warn" | tee "$out/throughput_gpt2.log"
timeout 170 python3 benchmarks/throughput.py --models llama-1b --micro 8 --seq-len 2048 \
    --steps 20 --float8 --breakdown-steps 0 --name throughput_cuda_llama1b --runs /tmp/runs \
    2>&1 | grep -v -i "warn" | tee "$out/throughput_llama1b.log"
cp benchmarks/results/throughput_cuda_*.json "$out/" 2>/dev/null
