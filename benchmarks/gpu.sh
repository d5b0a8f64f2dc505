#!/usr/bin/env bash
# The GPU checks of a lent machine (the device tool), in under 10 minutes; results land in $OUT.
#
# Prepare here, once (the machine reaches no registry; its image has torch, transformers, peft, accelerate,
# typer, rich, pyarrow and pyyaml, not pydantic or vLLM):
#   echo /.gpu/ >> .git/info/exclude
#   .venv/bin/python benchmarks/gpu.py --save-tokenizer .gpu/tokenizer
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .gpu/wheels pydantic pydantic-core annotated-types typing-inspection
# then run `bash benchmarks/gpu.sh` there with `.gpu` carried. vLLM's GPU wheel is larger than what a call
# carries; on a machine that has vllm installed every step below also runs the vllm engine.
source benchmarks/gpu_env.sh
nvidia-smi >"$OUT/summary.txt" 2>&1
engines=hf
$PY -c "import vllm" 2>/dev/null && engines="hf vllm"
echo "engines: $engines" | tee -a "$OUT/summary.txt"

# 1. The backend contract on CUDA, every engine here (about 1 minute).
REPERTORY_TEST_DEVICE=cuda REPERTORY_TEST_TOKENIZER=.gpu/tokenizer timeout 180 \
  $PY -m pytest -q -p no:cacheprovider tests/generation/test_backend_contract.py >"$OUT/contract.txt" 2>&1
tail -3 "$OUT/contract.txt" | tee -a "$OUT/summary.txt"

# 2. bench rollout per engine (and naive), throughput of the 0.5B shape at batch 256, bench train (4 minutes).
timeout 300 $PY benchmarks/gpu.py --tokenizer .gpu/tokenizer --out "$OUT/gpu.json" >"$OUT/gpu.log" 2>&1
echo "gpu.py exit $?" | tee -a "$OUT/summary.txt"

# 3. Two iterations of the default recipe on CUDA per engine, on a random model of the embedded one's shape.
$PY benchmarks/gpu.py --tokenizer .gpu/tokenizer --save-model /tmp/random-135m >>"$OUT/gpu.log" 2>&1
for engine in $engines; do
  timeout 150 $PY -c "from repertory.cli import main; main()" train --set iterations=2 --set eval.episodes=2 \
    --set model.name=/tmp/random-135m --set model.device=cuda --set rollout.backend="$engine" \
    --set output_dir=/tmp/runs --set name="gpu-$engine" >"$OUT/train-$engine.txt" 2>&1
  echo "train $engine exit $?" | tee -a "$OUT/summary.txt"
  cp /tmp/runs/gpu-"$engine"*/metrics.jsonl "$OUT/metrics-$engine.jsonl" 2>/dev/null
done
