#!/usr/bin/env bash
# One device call for the GPU throughput figures: `meshfit train`'s tokens/s, MFU and peak
# memory for GPT-2 124M (seq 1024) and llama-1b (seq 2048) at two micro-batches each, the
# step breakdown and a profiler trace of the best, and the fp32-vs-fast loss check; results
# and traces copied to $OUT. About 8-9 minutes on an H100/H200 (compilation included).
set -uo pipefail
out=${OUT:-runs/device}
mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
timeout 270 python3 benchmarks/throughput.py --models gpt2 --micro 8,16 --seq-len 1024 \
    --steps 30 --loss-check 0 --name throughput_cuda_gpt2 --runs "$out/runs" 2>&1 \
    | grep -v -i "warn" | tee "$out/throughput_gpt2.log"
timeout 300 python3 benchmarks/throughput.py --models llama-1b --micro 4,8 --seq-len 2048 \
    --steps 20 --breakdown-steps 3 --name throughput_cuda_llama1b --runs "$out/runs" 2>&1 \
    | grep -v -i "warn" | tee "$out/throughput_llama1b.log"
cp benchmarks/results/throughput_cuda_* "$out/" 2>/dev/null
find "$out/runs" -name 'throughput_trace_*.json.gz' -exec cp {} "$out/" \;
find "$out/runs" -type f -size +20M -delete  # weights and checkpoints; metrics stay
