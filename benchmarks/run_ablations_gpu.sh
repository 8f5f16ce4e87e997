#!/usr/bin/env bash
# The paper's directions as ablation grids, three seeds each (issue 18;
# benchmarks/results/ablations/README.md has the results and the table):
#
#   bash benchmarks/run_ablations_gpu.sh GRID [GRID ...]
#
# GRID: mtp (MTP on/off at equal training FLOPs), experts (16 experts top-4
# vs 4 top-1 at equal total and active parameters), attention_mqar (full /
# 1:1 hybrid / all-SWA on MQAR inside and beyond the window), attention_lm
# (full / 3:1 hybrid / all-SWA language-modelling loss on the stdlib
# corpus), gating (m2_small: sigmoid + bias vs softmax + aux loss, both with
# the router at lr x0.1), gating_sweep (the same two on the 4-layer sweep
# model, through experiments.sweep). Every arm is one process training its three seeds
# as one vmapped program (--parallel) into the grid's sweep directory; arms
# go to the GPUs (GPUS=0,1,..., default: every GPU nvidia-smi lists), two
# processes per GPU at most, each with 45% of its memory. Then
# experiments.report writes each grid's report. Results: $OUT/GRID/.
# On H100s: mtp and experts ~3 min each, attention_lm ~3 min, gating ~3 min
# per seed; attention_mqar ~18 min per arm (float32 with 32-wide experts:
# XLA's grouped matmul; benchmarks/notes/mqar.md says why and what would
# make it faster).
# EXTRA: flags appended to every run's command (a quick look: EXTRA=--steps=100;
# bench_router takes --steps too). Carry .whl (grain, array_record,
# portpicker, tensorboardX) where python3 has no grain.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -c "import grain" 2>/dev/null || python3 -m pip install -q --no-index \
  --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
IFS=', ' read -ra GPUS <<< "${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')}"
(( ${#GPUS[@]} )) || { echo "no GPU (nvidia-smi lists none; or set GPUS=0,1,...)"; exit 2; }
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
SLOTS=("${GPUS[@]}" "${GPUS[@]}")  # two process slots per GPU
PIDS=()
launch() {  # LOG COMMAND...: run in the background on a free slot's GPU
  local log=$1 slot; shift
  while true; do
    for slot in "${!SLOTS[@]}"; do
      if [[ -z ${PIDS[$slot]:-} ]] || ! kill -0 "${PIDS[$slot]}" 2>/dev/null; then
        echo "== GPU ${SLOTS[$slot]}: $*" | cut -c1-160
        CUDA_VISIBLE_DEVICES=${SLOTS[$slot]} "$@" > "$log" 2>&1 &
        PIDS[$slot]=$!
        return
      fi
    done
    wait -n
  done
}
SMALL=(--preset=tiny --override=compute_dtype=bfloat16 --override=hidden_size=256
  --override=num_layers=4 --override=num_heads=8 --override=num_kv_heads=4
  --override=head_dim=32 --override=rotary_dim=16 --override=num_mtp_modules=0
  --seq_len=1024 --batch_size=32 --learning_rate=3e-3 --window=128
  --eval_lengths=128,256 --examples_per_point=8 --seeds=0,1,2 --parallel)
TASKS=(--train_documents=60000 --drill_fraction=0.5)
declare -A ARMS=(
  [mtp]="mtp_off mtp_1" [experts]="fine_E16_top4 coarse_E4_top1"
  [attention_mqar]="full swa32_1to1 swa32_all"
  [attention_lm]="full swa128_3to1 swa128_all"
  [gating_sweep]="sigmoid_bias softmax_aux")
grid_flags() {  # GRID: the sweep flags of that grid
  case $1 in
    mtp) echo --grid=mtp "${SMALL[@]}" "${TASKS[@]}" \
      --override=moe_intermediate_size=256 --equal_compute --steps=800 ;;
    experts) echo --grid=experts "${SMALL[@]}" "${TASKS[@]}" \
      --override=num_experts=16 --override=num_experts_per_tok=4 \
      --override=moe_intermediate_size=128 --steps=800 ;;
    attention_mqar) echo --grid=attention --preset=tiny \
      --override=hidden_size=128 --override=num_layers=2 \
      --override=num_mtp_modules=0 --steps=5000 --seq_len=256 --batch_size=64 \
      --learning_rate=1e-3 --window=32 --train_documents=300000 \
      --mqar_fraction=0.8 --mqar_gaps=0,32,64 --eval_lengths=128,240 \
      --seeds=0,1,2 --parallel ;;
    gating_sweep) echo --grid=gating "${SMALL[@]}" "${TASKS[@]}" \
      --override=moe_intermediate_size=256 --steps=800 ;;
    attention_lm) echo --grid=attention "${SMALL[@]}" --data=stdlib \
      --override=moe_intermediate_size=256 --steps=800 --eval_lengths=128 \
      --examples_per_point=4 ;;
  esac
}
for grid in "$@"; do  # every name checked before anything starts
  [[ $grid == gating || -n ${ARMS[$grid]:-} ]] || {
    echo "unknown grid $grid (mtp experts attention_mqar attention_lm gating gating_sweep)"
    exit 2; }
done
(( $# )) || { echo "usage: $0 GRID [GRID ...]"; exit 2; }
mkdir -p "$OUT"
START=$(date +%s)
for grid in "$@"; do
  mkdir -p "$OUT/$grid"
  if [[ $grid == gating ]]; then
    for seed in 0 1 2; do
      launch "$OUT/gating/seed$seed.log" python3 -m experiments.bench_router \
        --preset=m2_small --steps=2000 --batch=8 --seq_len=512 --seeds=$seed \
        --arm="prop_1e-2_r0.1 bias_update=proportional bias_update_rate=1e-2 train.router_lr_scale=0.1" \
        --arm="softmax_aux_r0.1 gating=softmax use_routing_bias=false aux_loss_coef=0.01 train.router_lr_scale=0.1" \
        --out="$OUT/gating/router_seed$seed.json" ${EXTRA:-}
    done
    continue
  fi
  for arm in ${ARMS[$grid]}; do
    # shellcheck disable=SC2046
    launch "$OUT/$grid/$arm.log" python3 -m experiments.sweep \
      $(grid_flags "$grid") --variants="$arm" \
      --sweep_dir="${SWEEPS:-runs}/ablation_$grid" ${EXTRA:-}
  done
done
wait
echo "all arms done in $(( $(date +%s) - START )) s"
for grid in "$@"; do
  [[ $grid == gating ]] && continue
  dir=${SWEEPS:-runs}/ablation_$grid
  python3 -m experiments.report --sweep_dir="$dir" > /dev/null \
    && cp "$dir"/{results.json,report.md,*.png} "$OUT/$grid/"
  sed -n '/^| variant | seeds/,/^$/p;/^## Against/,$p' "$OUT/$grid/report.md"
done
