#!/usr/bin/env bash
# Issue 33's GPU figures on a lent machine (the device tool), in about 6 minutes; results land in $OUT.
# Prepare as for benchmarks/gpu.sh (tokenizer and pydantic wheels under .gpu, carried), then run
# `bash benchmarks/gpu_scale.sh` there. It measures, on a random model of the embedded one's shape:
#   1. asynchronous rollouts: benchmarks/async_rollouts.py (staleness 0 against 1, same samples) on CUDA;
#   2. one adapter per role against one shared adapter: rollout and learner throughput of two iterations of
#      Ultimatum self-play (constrained), every seat in one batched call either way.
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
