"""vLLM's inspection of the model's class, done in the worker's process: the same cache entry vLLM's own
subprocess writes, and with it vLLM starts no subprocess to inspect (a second vLLM import: 16 s on every pod
start, whose cache is a fresh emptyDir)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from iwg_worker.engine.vllm_engine import inspect_model_classes_here

pytestmark = [pytest.mark.slow]

ARCHITECTURE = "LlamaForCausalLM"  # SmolLM2's


def cache_entry(root: Path) -> dict[str, Any]:
    (entry,) = (root / "modelinfos").glob(f"*{ARCHITECTURE}.json")
    loaded: dict[str, Any] = json.loads(entry.read_text())
    return loaded


def test_the_worker_inspects_the_model_class_as_vllms_subprocess_does_and_vllm_then_spawns_none(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import envs
    from vllm.model_executor.models import ModelRegistry, registry

    envs.disable_envs_cache()  # an engine built earlier in this process froze vLLM's environment
    # vLLM's own way, into an empty cache: the class inspected in a new Python process.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    assert str(tmp_path / "vllm") == envs.VLLM_CACHE_ROOT
    ModelRegistry.models[ARCHITECTURE].inspect_model_cls()

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "worker"))
    assert inspect_model_classes_here(str(smollm2)) == [ARCHITECTURE]
    assert cache_entry(tmp_path / "worker") == cache_entry(tmp_path / "vllm")
    assert registry._run_in_subprocess.__name__ == "_run_in_subprocess"  # vLLM's runner is back

    def no_subprocess(fn: Any) -> Any:
        raise AssertionError("vLLM inspected the model class in a subprocess")

    # What the engine core does next (in its own process, with the same VLLM_CACHE_ROOT): no subprocess.
    monkeypatch.setattr(registry, "_run_in_subprocess", no_subprocess)
    assert ModelRegistry.models[ARCHITECTURE].inspect_model_cls().is_text_generation_model
