#!/usr/bin/env bash
# One single-GPU session on the device machine, in priority order:
#   1. m2_small training throughput with the Pallas grouped matmul (issue 4)
#   2. the grouped-matmul benchmark against its peers (issue 3)
#   3. a short real pretraining run of m2_small on the embedded corpus
#   4. the same throughput with the XLA ragged_dot reference
# Needs .whl (grain) and .peers (tokamax) carried; results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl .peers/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.peers/stub:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { grep -v '^[IW][0-9]\{4\} '; }
timeout 150 python3 -m experiments.bench_train --preset=m2_small --batch_size=8 \
  --seq_len=2048 --steps=10 --backends=pallas --output=$OUT/train_m2_small.json 2>&1 | quiet
timeout 240 python3 -m experiments.bench_gmm --out=$OUT/gmm_h100.json 2>&1 | quiet | tail -40
timeout 120 python3 -m experiments.pretrain --preset=m2_small --steps=30 --seq_len=2048 \
  --batch_size=8 --log_every=10 --eval_every=30 --eval_batches=2 --checkpoint_every=30 \
  --learning_rate=1e-3 --warmup_steps=5 --sample_tokens=0 --workdir=/tmp/gpu_run 2>&1 \
  | tr '\r' '\n' | grep -v 'pretrain:' | quiet | tail -8
cp /tmp/gpu_run/metrics.jsonl $OUT/pretrain_m2_small_metrics.jsonl 2>/dev/null
timeout 60 python3 -m experiments.bench_train --preset=m2_small --batch_size=8 \
  --seq_len=2048 --steps=3 --backends=xla --output=$OUT/train_m2_small_xla.json 2>&1 | quiet | tail -3
