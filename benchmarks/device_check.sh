#!/usr/bin/env bash
# GPU checks for a lent CUDA machine: the CUDA tests, then `meshfit train` on the GPU (the
# tiny default and GPT-2 small in bf16) for throughput figures. Logs go to $OUT (the device
# tool's folder) or runs/device. Usage: bash benchmarks/device_check.sh
set -uo pipefail
out=${OUT:-runs/device}
mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    | tee "$out/env.txt"
timeout 150 python3 -m pytest -o addopts=-ra -q -p no:cacheprovider tests/distributed/test_cuda.py 2>&1 \
    | tee "$out/test_cuda.log"
timeout 90 python3 -m meshfit train --nproc 1 --out "$out/tiny" 2>&1 | tail -3
timeout 120 python3 -m meshfit train --nproc 1 --out "$out/gpt2" --model.preset=gpt2 \
    --train.steps=60 --train.global_batch_size=32 --train.micro_batch_size=16 \
    --train.seq_len=1024 --train.mixed_precision=bf16 --train.eval_every=30 \
    --train.log_every=10 2>&1 | tail -3
for r in tiny gpt2; do
    cp "$out/$r/metrics.jsonl" "$out/metrics_$r.jsonl" 2>/dev/null && rm -rf "${out:?}/$r"
done
# The CPU suite against the device's own torch release (a compatibility check of the range).
CUDA_VISIBLE_DEVICES= timeout 150 python3 -m pytest -o addopts=-ra -q -x -p no:cacheprovider \
    2>&1 | tail -5 | tee "$out/cpu_suite.log"
