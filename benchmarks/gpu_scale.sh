#!/usr/bin/env bash
# Issue 33's GPU figures on a lent machine (the device tool), in about 8 minutes; results land in $OUT.
# Prepare as for benchmarks/gpu.sh (tokenizer and pydantic wheels under .gpu, carried), then run
# `bash benchmarks/gpu_scale.sh` there. It measures, on a random model of the embedded one's shape:
#   1. asynchronous rollouts: benchmarks/async_rollouts.py (staleness 0 against 1, same samples) on CUDA;
#   2. one adapter per role against one shared adapter: rollout and learner throughput of two iterations of
#      Ultimatum self-play (constrained), every seat in one batched call either way;
#   3. with two GPUs or more, the sharded learner's memory per GPU (benchmarks/sharded_memory.py) on random
#      weights of 1.5B parameters, data-parallel against model.sharding fsdp;
#   4. with two GPUs or more and vllm installed, the sharded learner syncing an engine per GPU: two iterations
#      of --gpus 2 with model.sharding fsdp on the vllm backend (offpolicy/max_gap: sampler against learner).
source benchmarks/gpu_env.sh
$PY benchmarks/gpu.py --tokenizer .gpu/tokenizer --save-model /tmp/random-135m >"$OUT/scale.log" 2>&1
on_gpu=(--set model.name=/tmp/random-135m --set model.device=cuda --set rollout.kernels_per_iteration=16)

# 1. async against sync (about 3 minutes)
timeout 240 $PY benchmarks/async_rollouts.py "${on_gpu[@]}" >"$OUT/async.json" 2>>"$OUT/scale.log"
echo "async_rollouts exit $?" | tee -a "$OUT/summary-scale.txt"

# 2. per-role against shared adapters (about 2 minutes)
for adapters in shared per_role; do
  timeout 120 $PY -c "from repertory.cli import main; main()" train --quiet "${on_gpu[@]}" --set iterations=2 \
    --set eval.episodes=0 --set rollout.env=ultimatum --set eval.opponent=bot --set model.adapters="$adapters" \
    --set output_dir=/tmp/runs --set name="roles-$adapters" >"$OUT/roles-$adapters.txt" 2>&1
  echo "train $adapters exit $?" | tee -a "$OUT/summary-scale.txt"
  cp /tmp/runs/roles-"$adapters"*/metrics.jsonl "$OUT/roles-$adapters.jsonl" 2>/dev/null
done

# 3. sharded against data-parallel memory per GPU (about 3 minutes; needs two GPUs to shard over)
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  timeout 300 $PY benchmarks/sharded_memory.py --processes "$gpus" --shape 1.5b --device cuda \
    --set rollout.max_new_tokens=32 >"$OUT/sharded-memory.json" 2>>"$OUT/scale.log"
  echo "sharded_memory exit $?" | tee -a "$OUT/summary-scale.txt"
else
  echo "sharded_memory skipped: $gpus GPU (FSDP shards over two or more)" | tee -a "$OUT/summary-scale.txt"
fi

# 4. fsdp with a vLLM engine per GPU (about 2 minutes; two GPUs and vllm)
if [ "$gpus" -ge 2 ] && $PY -c "import vllm" 2>/dev/null; then
  timeout 240 $PY -c "from repertory.cli import main; main()" train --quiet --gpus 2 "${on_gpu[@]}" \
    --set iterations=2 --set eval.episodes=0 --set model.sharding=fsdp --set rollout.backend=vllm \
    --set output_dir=/tmp/runs --set name=fsdp-vllm >"$OUT/fsdp-vllm.txt" 2>&1
  echo "fsdp vllm exit $?" | tee -a "$OUT/summary-scale.txt"
  cp /tmp/runs/fsdp-vllm*/metrics.jsonl "$OUT/fsdp-vllm.jsonl" 2>/dev/null
else
  echo "fsdp vllm skipped: $gpus GPU or no vllm" | tee -a "$OUT/summary-scale.txt"
fi
