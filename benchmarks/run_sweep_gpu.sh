#!/usr/bin/env bash
# One ablation grid on the device machine (single GPU), within one call:
#   bash benchmarks/run_sweep_gpu.sh GRID VARIANTS STEPS [extra sweep flags]
# The base model: 4 layers, hidden 256, GQA 8/4 (head_dim 32), 8 experts
# top-2 (F=256), bf16; 32 x 1024 tokens per step; synthetic task documents
# with half retrieval drills. Seed 0 of every arm first, then seed 1 (the
# sweep resumes), so a call that runs out of time still covers every arm;
# PARALLEL=1 instead trains all SEEDS of an arm as one vmapped program
# (--parallel, m2jax.train.multi), arm after arm.
# Carry .whl (grain, array_record, portpicker, tensorboardX). Results: $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
GRID=$1 VARIANTS=$2 STEPS=$3; shift 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
DIR=/tmp/sweep_$GRID
SEEDS=${SEEDS:-0,1}  # SEEDS=0: one seed only
START=$(date +%s)
DEADLINE=$(( START + ${BUDGET_S:-540} ))
run() {  # run SEEDS [more sweep flags]: one resumable sweep invocation
  local seeds=$1 left=$(( DEADLINE - $(date +%s) ))
  shift
  (( left > 0 )) || return 0
  timeout $left python3 -m experiments.sweep --grid=$GRID --variants=$VARIANTS \
    --preset=tiny --override=compute_dtype=bfloat16 --override=hidden_size=256 \
    --override=num_layers=4 --override=num_heads=8 --override=num_kv_heads=4 \
    --override=head_dim=32 --override=rotary_dim=16 \
    --override=moe_intermediate_size=256 --override=num_mtp_modules=0 \
    --steps=$STEPS --seq_len=1024 --batch_size=32 --learning_rate=3e-3 \
    --window=128 --eval_lengths=128,256,512,960 --examples_per_point=32 \
    --train_documents=60000 --drill_fraction=0.5 --sweep_dir=$DIR \
    --seeds=$seeds "$@" 2>&1 | tr '\r' '\n' | grep -E '^\[sweep|Error|error' | tail -20
}
if [[ -n "${PARALLEL:-}" ]]; then  # every seed of an arm in one program
  run "$SEEDS" --parallel "$@"
else
  run 0 "$@"
  run "$SEEDS" "$@"
fi
echo "sweep took $(( $(date +%s) - START )) s"
mkdir -p $OUT/$GRID
cp $DIR/results.json $OUT/$GRID/ 2>/dev/null
for d in $DIR/runs/*/seed*; do  # flat names: deep folders do not come back
  v=${d#$DIR/runs/}; cp $d/metrics.jsonl $OUT/$GRID/metrics_${v/\//_}.jsonl
done
python3 -c "
import json; r = json.load(open('$DIR/results.json'))
for x in r['runs']:
  print(x['variant'], x['seed'], round(x['val_loss'], 4), {t: list(s.values()) for t, s in x['tasks'].items()}, x['routing'])
"
