# Sourced by benchmarks/gpu.sh and benchmarks/gpu_scale.sh: $OUT, $PY, the source tree on PYTHONPATH, offline
# Hugging Face, and the carried pydantic wheels (.gpu/wheels) installed where the lent machine lacks them.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
