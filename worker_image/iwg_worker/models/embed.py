"""Task ``embed``: a local Hugging Face encoder, mean pooling over real tokens, L2 normalisation.

The same computation as sentence-transformers' Transformer -> Pooling(mean) -> Normalize pipeline, without
the dependency: ``max_seq_length`` comes from ``sentence_bert_config.json`` when the directory has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class EmbeddingModel:
    def __init__(
        self,
        path: str,
        device: torch.device,
        dtype: torch.dtype,
        max_seq_length: int | None = None,
        world_size: int = 1,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        from iwg_worker.models.sharding import distributed_kwargs

        root = Path(path)
        if not (root / "config.json").is_file():
            raise ValueError(f"model_path {path!r} is not a Hugging Face model directory (no config.json)")
        self.device = device
        self.tokenizer: Any = AutoTokenizer.from_pretrained(root, local_files_only=True)
        loaded: Any = AutoModel.from_pretrained(
            root, local_files_only=True, dtype=dtype, **distributed_kwargs(world_size)
        )
        self.model: Any = (loaded.to(device) if world_size == 1 else loaded).eval()
        self.max_seq_length = (
            max_seq_length or _sentence_bert_max_length(root) or self.tokenizer.model_max_length
        )
        self.dimension = int(self.model.config.hidden_size)

    def embed(self, texts: list[str]) -> torch.Tensor:
        return self.embed_counted(texts)[0]

    @torch.inference_mode()
    def embed_counted(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings and each input's token count (after truncation), for the driver's usage figures."""
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise TypeError("batch field 'inputs' must be a list of strings")
        if not texts:
            return torch.empty((0, self.dimension), dtype=torch.float32), torch.empty((0,), dtype=torch.int64)
        encoded = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        counts = encoded["attention_mask"].sum(dim=1).to(torch.int64).cpu()
        return torch.nn.functional.normalize(pooled.float(), p=2, dim=1).cpu(), counts


def _sentence_bert_max_length(root: Path) -> int | None:
    config = root / "sentence_bert_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_seq_length")
    return int(value) if value else None
