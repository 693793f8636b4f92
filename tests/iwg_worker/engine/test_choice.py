"""Which engine a generation worker runs (`spec.model.engine` resolved on the worker), and the clear start
failures of `engine: vllm` where vLLM cannot serve the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from iwg_worker.engine import choice
from iwg_worker.engine.choice import EngineUnavailable, cpu_budget, resolve_engine
from iwg_worker.torch_worker import TorchWorker
from iwg_worker.worker_base import WorkerConfig

from tests.models import smollm2_gguf


def unknown_architecture(tmp_path: Path) -> Path:
    """A model directory whose architecture vLLM does not implement (only its config matters here)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    return tmp_path


def test_auto_picks_vllm_for_a_directory_of_an_architecture_it_implements(smollm2: Path) -> None:
    assert resolve_engine("auto", str(smollm2), "cpu") == "vllm"


def test_auto_falls_back_to_transformers_for_what_vllm_cannot_serve(tmp_path: Path) -> None:
    assert resolve_engine("auto", str(smollm2_gguf()), "cpu") == "transformers"
    assert resolve_engine("auto", str(unknown_architecture(tmp_path)), "cpu") == "transformers"


def test_transformers_is_always_transformers(smollm2: Path) -> None:
    assert resolve_engine("transformers", str(smollm2), "cpu") == "transformers"


def test_vllm_refuses_a_gguf_file_naming_the_field() -> None:
    with pytest.raises(EngineUnavailable, match=r"spec.model.engine is vllm, but .* is a GGUF file"):
        resolve_engine("vllm", str(smollm2_gguf()), "cpu")


def test_vllm_not_installed_fails_the_start_naming_the_field(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(choice, "vllm_installed", lambda: False)
    with pytest.raises(EngineUnavailable, match=r"spec\.model\.engine is vllm, but vLLM is not installed"):
        resolve_engine("vllm", str(smollm2), "cpu")
    assert resolve_engine("auto", str(smollm2), "cpu") == "transformers"


def test_a_model_vllm_cannot_load_fails_the_workers_start_in_vllms_words(
    smollm2: Path, tmp_path: Path
) -> None:
    """SmolLM2's weights and tokenizer under a configuration naming an architecture vLLM lacks."""
    for part in smollm2.iterdir():
        if part.name != "config.json":
            (tmp_path / part.name).symlink_to(part)
    config = json.loads((smollm2 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    worker = TorchWorker(
        WorkerConfig(
            task="generate",
            model_path=str(tmp_path),
            device="cpu",
            engine="vllm",
            enforce_eager=True,
        )
    )
    worker.init_device()
    with pytest.raises(Exception, match="NoSuchModelForCausalLM"):
        worker.load_model()


def test_the_cpu_budget_is_the_affinity_at_most() -> None:
    import os

    assert 1 <= cpu_budget() <= len(os.sched_getaffinity(0))
