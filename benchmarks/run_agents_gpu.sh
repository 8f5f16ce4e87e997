#!/bin/bash
# Issue 16's GPU targets, one section per device call (each fits 10 minutes):
#
#   benchmarks/run_agents_gpu.sh gateway   128 black-box sessions against
#       experiments.serve --record (m2_small), refusals mid-load, SIGKILL
#       after half the ends (experiments/bench_gateway.py)
#   benchmarks/run_agents_gpu.sh merge     records agent trajectories (the
#       tiny dense model's warm start and 3 black-box RL steps,
#       experiments/agent_learning.py), then times m2_small's train step on
#       them merged vs unmerged (experiments/bench_rl.py --sections=merge)
#   benchmarks/run_agents_gpu.sh mtp       MTP acceptance over 200 RL steps
#       with co-training (default) and without (--mtp_weight=0), m2_small,
#       --mtp_draft=1, the two arms at once on two GPUs; resumable: call it
#       again until both are done (runs persist on a warm machine; on an
#       H100 ~0.55 s a step after ~200 s of compiling). BUDGET s per call.
#   benchmarks/run_agents_gpu.sh learning  the learning target: one warm
#       start, then 3 seeds x {white-box, black-box} RL runs of the tiny dense
#       model widened to 4 x 256 (MODEL) on the multiply task
#       (experiments/agent_learning.py) at lr 1e-4 (LR; 3e-4 collapsed 2 of
#       3 seeds), an arm per process (ceil(6 / GPUs) per GPU); resumable
#       (call again until every run has STEPS steps), then --stage=report
#       into $OUT/agents_learning.json and .png. GPUS=2,3 keeps the arms to
#       those GPUs; WORKDIR (default runs/agent_learning) holds the runs;
#       EXTRA: more agent_learning flags. The 2026-11-27 runs
#       (benchmarks/results/agents_learning/lr1e-4_h100.*): three calls of
#       ~9 minutes with three runs per GPU on GPUs 2-3 of a 4-GPU host.
#   benchmarks/run_agents_gpu.sh learning_cpu  the same six RL runs on the
#       host's CPU cores (JAX_PLATFORMS=cpu, CPU_PER cores each of
#       CPU_CORES), from a warm start made on a GPU: the learning target as
#       the issue words it ("on CPU"), on a host with more than 2 cores.
#
# Carry .whl (../shared/tools/wheels-for-gpu .whl grain array_record
# portpicker tensorboardX); results land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=$PWD/.jax_cache
nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v '^[IW][0-9]\{4\} \|WARNING'; }
mkdir -p "$OUT"
T0=$(date +%s)
case "${1:-gateway}" in
  gateway)
    timeout -s KILL 500 python3 -m experiments.bench_gateway \
      --preset=m2_small --sessions=128 --calls=3 --max_tokens=32 \
      --max_batch=128 --num_pages=2048 --max_seq_len=256 \
      --out="$OUT/gateway_h100.json" 2>&1 | quiet | tail -8 ;;
  merge)
    timeout -s KILL 300 python3 -m experiments.agent_learning \
      --workdir=runs/agent_pool --agents=blackbox --seeds=0 \
      --warm_start_steps=300 --steps=3 --groups_per_step=16 \
      --out="$OUT/agent_pool_runs.json" 2>&1 | quiet | tail -4
    timeout -s KILL 250 python3 -m experiments.bench_rl --preset=m2_small \
      --sections=merge --merge_pool=runs/agent_pool/blackbox-s0/pool.sqlite \
      --merge_reps=3 --merge_row_len=1024 \
      --out="$OUT/rl_merge_agents_h100.json" 2>&1 | quiet | tail -5 ;;
  mtp)
    # lr 1e-4: at 2e-4 (the 2026-11-27 run) the co-trained arm's policy went
    # near-deterministic, which confounds its acceptance (notes/agents.md).
    # Both arms at once, one GPU each (GPU_CO, GPU_FROZEN; default 0 and 1);
    # the frozen arm waits for the co-trained arm's warm start and starts
    # from it. Each arm resumes where an earlier call left it.
    STEPS=${STEPS:-200}; BUDGET=${BUDGET:-560}
    COMMON="--preset=m2_small --env=arithmetic --env_config=levels=1
      --steps=$STEPS --groups_per_step=${RL_GROUPS:-16} --group_size=8
      --max_new_tokens=12 --learning_rate=${LR:-1e-4} --mtp_draft=1
      --eval_every=0 --checkpoint_every=10 --max_batch=128 --num_pages=4096"
    arm() {  # name gpu
      local dir=runs/mtp_$1 extra resume=""
      if [ $1 = co ]; then
        # --mtp_reference: the warm start's MTP module, frozen, scored on
        # this arm's own policy every step (mtp/ref_*): without co-training
        # on the same policy, free of the two arms' drift apart.
        extra="--warm_start_steps=60 --warm_start_learning_rate=1e-3 --mtp_reference"
      else
        until [ -d runs/mtp_co/warm_start/checkpoints/60 ]; do
          sleep 5; [ $(( $(date +%s) - T0 )) -gt $BUDGET ] && return
        done
        extra="--init=runs/mtp_co/warm_start --warm_start_steps=0 --mtp_weight=0"
      fi
      # A started run resumes, from its newest checkpoint or, before its
      # first one, from its start again (its pool exists from step 1).
      { ls $dir/checkpoints 2>/dev/null | grep -q . || [ -e $dir/pool.sqlite ]; } \
        && resume="--resume"
      local left=$(( BUDGET - ($(date +%s) - T0) ))
      echo "== $1: $(wc -l < $dir/metrics.jsonl 2>/dev/null || echo 0) steps done, $left s left $resume"
      CUDA_VISIBLE_DEVICES=$2 timeout -s KILL $left python3 -m experiments.rl \
        $COMMON $extra $resume --workdir=$dir 2>&1 | quiet | tail -3
      cp $dir/metrics.jsonl "$OUT/mtp_$1_metrics.jsonl" 2>/dev/null
    }
    arm co ${GPU_CO:-0} & arm frozen ${GPU_FROZEN:-1} & wait ;;
  learning|learning_cpu)
    # learning_cpu: the same six RL runs with JAX_PLATFORMS=cpu, each
    # pinned to its own CPU_PER cores of this host's CPU_CORES (default: all
    # but the first 16, which the GPU jobs of the same call use); the warm
    # start is still made on a GPU (400 SFT steps: a minute there, ~45
    # minutes on 2 CPU cores), the RL runs, where the learning happens,
    # never touch one. Both resumable (call again until every run has
    # STEPS steps).
    cpu=$([ $1 = learning_cpu ] && echo 1 || echo "")
    STEPS=${STEPS:-400}; BUDGET=${BUDGET:-560}
    W=${WORKDIR:-runs/agent_learning${cpu:+_cpu}}
    L="--workdir=$W --warm_start_steps=${WARM_STEPS:-400}
      --warm_start_learning_rate=${WARM_LR:-1e-3} --learning_rate=${LR:-1e-4}
      ${MODEL:---hidden_size=256 --num_layers=4} --steps=$STEPS
      --groups_per_step=16 --checkpoint_every=5 ${EXTRA:-}"
    IFS=', ' read -ra G <<< "${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')}"
    (( ${#G[@]} )) || { echo "no GPU"; exit 2; }
    CUDA_VISIBLE_DEVICES=${G[0]} timeout -s KILL $BUDGET python3 -m experiments.agent_learning $L \
      --stage=warm 2>&1 | quiet | tail -2 | cut -c1-400
    # The arms start only from a finished warm start (it is measured last).
    [ -f $W/warm/measured.json ] || {
      echo "warm start unfinished: call again"; exit 1; }
    if [ -n "$cpu" ]; then
      CORES=${CPU_CORES:-16-$(( $(nproc) - 1 ))}; first=${CORES%-*}; last=${CORES#*-}
      n=$(( last - first + 1 )); per=${CPU_PER:-$(( n >= 6 ? n / 6 : 1 ))}
      echo "== CPU runs: cores $CORES, $per each"
    else
      # Six arms over the GPUs: at most ceil(6 / GPUs) processes share one.
      per_gpu=$(( (6 + ${#G[@]} - 1) / ${#G[@]} ))
      export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $per_gpu, 2))")
    fi
    i=0
    for agent in whitebox blackbox; do
      for seed in 0 1 2; do
        left=$(( BUDGET - ($(date +%s) - T0) ))
        (( left > 60 )) || { echo "out of budget before $agent s$seed"; break 2; }
        if [ -n "$cpu" ]; then
          lo=$(( first + (i * per) % n ))
          place="env CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu taskset -c $lo-$(( lo + per - 1 ))"
        else
          place="env CUDA_VISIBLE_DEVICES=${G[$(( i % ${#G[@]} ))]}"
        fi
        timeout -s KILL $left $place python3 -m experiments.agent_learning $L \
          --agents=$agent --seeds=$seed >> "$OUT/learning${cpu:+_cpu}_${agent}_s$seed.log" 2>&1 &
        i=$(( i + 1 ))
      done
    done
    wait
    place="env CUDA_VISIBLE_DEVICES=${G[0]}"
    [ -n "$cpu" ] && place="env CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu"
    timeout 120 $place python3 -m experiments.agent_learning $L --stage=report \
      --out="$OUT/agents_learning${cpu:+_cpu}.json" 2>&1 | quiet | grep -o \
      '"agent": "[a-z]*", "seed": [0-9], "steps": [0-9]*' ;;
  *) echo "usage: $0 gateway|merge|mtp|learning|learning_cpu"; exit 2 ;;
esac
