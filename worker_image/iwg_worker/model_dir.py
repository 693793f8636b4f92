"""What a Hugging Face model directory holds, read without loading the model: whether it is one at all (so
`iwg serve` can say what is missing before it starts workers), and the limits the driver checks requests
against (the vocabulary size, the context length)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The weight files `from_pretrained` loads, single-file or sharded (with their index).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json")


def missing_parts(path: Path, task: str) -> list[str]:
    """What `path` lacks to be served for `task`, as phrases for a person; empty when nothing is missing.

    A `.gguf` file holds a whole model (weights, tokenizer, configuration) and lacks nothing."""
    if path.is_file() and path.suffix == ".gguf":
        return []
    if not path.is_dir():
        return [f"{path} is not a directory"]
    missing: list[str] = []
    config = read_config(path)
    if config is None:
        missing.append("config.json (the model's configuration) is missing or not a JSON object")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"no weights: none of {', '.join(WEIGHT_FILES)}")
    if task == "embed" and not any((path / name).is_file() for name in TOKENIZER_FILES):
        # A generate worker takes token ids without a tokenizer; an embedding worker only takes text.
        missing.append(f"no tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    return missing


def read_config(path: Path) -> dict[str, Any] | None:
    """`config.json` of a model directory, or None when it is absent or not a JSON object."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def vocab_size(path: Path) -> int | None:
    """The model's vocabulary size from its `config.json`, None when unknown."""
    return _config_int(read_config(path), "vocab_size")


def context_length(path: Path) -> int | None:
    """How many positions the model takes (prompt and generated tokens together), None when unknown."""
    return _config_int(read_config(path), "max_position_embeddings", "n_positions", "n_ctx")


def _config_int(config: dict[str, Any] | None, *keys: str) -> int | None:
    """The first positive integer under one of `keys`, at the top of `config` or in its `text_config`."""
    if config is None:
        return None
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            for key in keys:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None
