#!/usr/bin/env bash
# Single-GPU benchmarks on the device machine, one stage per call (each fits
# the 10-minute call limit; m2_small's train step alone takes ~200 s to
# compile on an H100):
#   bash benchmarks/run_h100.sh train      m2_small tokens/s and MFU (issue 4)
#   bash benchmarks/run_h100.sh gmm        grouped matmul vs peers (issue 3)
#   bash benchmarks/run_h100.sh pretrain   a short real run of m2_small on the
#                                          embedded corpus (grain on the GPU host)
#   bash benchmarks/run_h100.sh gpu_tests  the tests that need a GPU (compiled
#                                          kernels, tokamax's private names)
#   bash benchmarks/run_h100.sh prefix_attention | prefix_model | prefix_agent128
#                                          experiments.bench_prefix_tree sections
#   bash benchmarks/run_h100.sh decode_kernel  paged decode attention
#                                          (experiments.bench_decode, issue 14)
#   bash benchmarks/run_h100.sh checkpoint what a checkpoint every 100 steps
#                                          costs m2_small's training, per save
#                                          mode (experiments.bench_checkpoint)
# Carry .whl (grain, array_record, portpicker, tensorboardX) and .peers
# (tokamax; see ../shared/wheels); results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl .peers/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/.peers/stub:$PWD PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=$PWD/.jax_cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { grep -v '^[IW][0-9]\{4\} '; }
case "${1:-train}" in
  train)
    timeout 500 python3 -m experiments.bench_train --preset=m2_small \
      --batch_size=8 --seq_len=2048 --steps=10 --backends=mosaic \
      --output=$OUT/train_m2_small.json 2>&1 | quiet ;;
  gmm)
    timeout 540 python3 -m experiments.bench_gmm --out=$OUT/gmm_h100.json \
      2>&1 | quiet | tail -40 ;;
  pretrain)
    timeout 540 python3 -m experiments.pretrain --preset=m2_small --steps=60 \
      --seq_len=2048 --batch_size=8 --log_every=10 --eval_every=60 \
      --eval_batches=2 --checkpoint_every=60 --learning_rate=1e-3 \
      --warmup_steps=5 --sample_tokens=0 --workdir=/tmp/gpu_run 2>&1 \
      | tr '\r' '\n' | grep -v 'pretrain:' | quiet | tail -8
    cp /tmp/gpu_run/metrics.jsonl $OUT/pretrain_m2_small_metrics.jsonl ;;
  gpu_tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gmm.py::test_compiled_kernels_on_gpu tests/test_private_api.py \
      2>&1 | tail -15 ;;
  prefix_attention)
    timeout 560 python3 -m experiments.bench_prefix_tree \
      --sections=attention,kernels --out=$OUT/prefix_tree_attention_h100.json \
      2>&1 | quiet | tail -40 ;;
  prefix_model)
    timeout 560 python3 -m experiments.bench_prefix_tree --sections=model \
      --out=$OUT/prefix_tree_model_h100.json 2>&1 | quiet | tail -20 ;;
  prefix_agent128)
    timeout 560 python3 -m experiments.bench_prefix_tree --sections=model \
      --model_cases=b_agent --agent_steps=128 --noagent_rewrite \
      --out=$OUT/prefix_tree_agent128_h100.json 2>&1 | quiet | tail -20 ;;
  decode_kernel)
    timeout 560 python3 -m experiments.bench_decode --sections=kernel \
      --out=$OUT/decode_kernel_h100.json 2>&1 | quiet | tail -60 ;;
  checkpoint)
    timeout 560 python3 -m experiments.bench_checkpoint --preset=m2_small \
      --batch_size=8 --seq_len=2048 --steps=200 --checkpoint_every=100 \
      --workdir=/tmp/bench_ckpt --output=$OUT/checkpoint_h100.json 2>&1 \
      | quiet | tail -8 ;;
  *) echo "unknown stage $1 (train, gmm, pretrain, gpu_tests, prefix_attention,"\
       "prefix_model, prefix_agent128, decode_kernel, checkpoint)"; exit 2 ;;
esac
