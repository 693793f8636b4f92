"""Task ``generate``: a causal LM decoded token by token with a KV cache; greedy or seeded sampling."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch


class CausalLM:
    def __init__(self, path: str, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        root = Path(path)
        if not (root / "config.json").is_file():
            raise ValueError(f"model_path {path!r} is not a Hugging Face model directory (no config.json)")
        self.device = device
        loaded: Any = AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=dtype)
        self.model: Any = loaded.to(device).eval()
        has_tokenizer = any(
            (root / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")
        )
        self.tokenizer: Any = (
            AutoTokenizer.from_pretrained(root, local_files_only=True) if has_tokenizer else None
        )
        self.eos_token_id: int | None = self.model.config.eos_token_id
        # transformers 5 renamed the KV cache argument and output field from past_key_values to cache.
        params = inspect.signature(self.model.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"

    def _prompt_ids(self, batch: dict[str, Any]) -> list[list[int]]:
        if "input_ids" in batch:
            ids = batch["input_ids"]
            if not (isinstance(ids, list) and all(isinstance(s, list) and s for s in ids)):
                raise TypeError("batch field 'input_ids' must be a list of non-empty token id lists")
            return [[int(t) for t in seq] for seq in ids]
        if "prompts" in batch:
            if self.tokenizer is None:
                raise ValueError(
                    "batch field 'prompts' needs a tokenizer in the model directory; send 'input_ids'"
                )
            return [list(self.tokenizer(p)["input_ids"]) for p in batch["prompts"]]
        raise ValueError("a generate batch needs field 'input_ids' or 'prompts'")

    @torch.inference_mode()
    def generate(self, batch: dict[str, Any]) -> dict[str, Any]:
        max_tokens = int(batch.get("max_tokens", 16))
        if max_tokens < 1:
            raise ValueError(f"batch field 'max_tokens' must be >= 1, got {max_tokens}")
        temperature = float(batch.get("temperature", 0.0))
        if temperature < 0:
            raise ValueError(f"batch field 'temperature' must be >= 0, got {temperature}")
        seed = batch.get("seed")
        outputs = []
        prompts = self._prompt_ids(batch)
        for index, prompt in enumerate(prompts):
            generator = None
            if temperature > 0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(int(seed) + index if seed is not None else torch.seed())
            outputs.append(self._decode_one(prompt, max_tokens, temperature, generator))
        result: dict[str, Any] = {"token_ids": outputs, "prompt_tokens": [len(p) for p in prompts]}
        if self.tokenizer is not None:
            result["text"] = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
        return result

    def _decode_one(
        self, prompt: list[int], max_tokens: int, temperature: float, generator: torch.Generator | None
    ) -> list[int]:
        input_ids = torch.tensor([prompt], device=self.device)
        past = None
        generated: list[int] = []
        for _ in range(max_tokens):
            out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_name: past})
            past = out[self._cache_name]
            logits = out.logits[0, -1].float()
            if generator is None:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            generated.append(token)
            if token == self.eos_token_id:
                break
            input_ids = torch.tensor([[token]], device=self.device)
        return generated
