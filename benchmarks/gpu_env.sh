# Sourced by the device scripts (benchmarks/gpu_*.sh): $OUT, carried wheels from .whl/ installed
# into /tmp/site, the repo on PYTHONPATH, unbuffered quiet output, and $B = the latency bench.
OUT=${OUT:-/tmp/blitz_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 BLITZ_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false
B="python3 -m blitzllm.cli bench latency"
