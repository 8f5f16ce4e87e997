#!/usr/bin/env bash
# Several sweep models in one vmapped program on one GPU (issue 18, item 3),
# the sweep's base model (benchmarks/run_sweep_gpu.sh: 4 layers, hidden 256,
# 8 experts top-2, bf16, 32 x 1024 tokens per step per model):
#   bash benchmarks/run_sweep_vmap_gpu.sh step    N = 1, 2, 3, 6, 12 per
#       program, Mosaic gmm (auto) and XLA's ragged_dot: tokens/s, TFLOP/s,
#       MFU vs the 989 TFLOP/s bf16 peak, nvidia-smi's busy % (~6 min)
#   bash benchmarks/run_sweep_vmap_gpu.sh sweep   3 seeds x 100 steps as a
#       sweep trains them: one by one vs one program, wall time (~4 min)
# Carry .whl (grain, array_record, portpicker, tensorboardX); results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MODEL=(--preset=tiny --override=compute_dtype=bfloat16 --override=hidden_size=256
  --override=num_layers=4 --override=num_heads=8 --override=num_kv_heads=4
  --override=head_dim=32 --override=rotary_dim=16
  --override=moe_intermediate_size=256 --override=num_mtp_modules=0
  --batch_size=32 --seq_len=1024)
quiet() { grep -v -e '^[IW][0-9]\{4\} ' -e 'validation next-token loss'; }
case "${1:-step}" in
  step)
    timeout 560 python3 -m experiments.bench_sweep_vmap "${MODEL[@]}" \
      --models=1,2,3,6,12 --steps=10 --backends=auto,xla \
      --output=$OUT/sweep_vmap_step_gpu.json 2>&1 | quiet ;;
  sweep)
    timeout 560 python3 -m experiments.bench_sweep_vmap "${MODEL[@]}" \
      --models=1,3 --steps=10 --backends=auto --sweep_steps=100 \
      --sweep_models=3 --output=$OUT/sweep_vmap_sweep_gpu.json 2>&1 | quiet ;;
  *) echo "unknown stage $1"; exit 2 ;;
esac
