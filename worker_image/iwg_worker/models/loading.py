"""Where a model's weights come from: a Hugging Face model directory, or a single GGUF file.

``spec.model.path`` may name either. A directory must hold ``config.json`` and weights (safetensors or a
PyTorch checkpoint); a ``.gguf`` file is dequantised by transformers on load (needs the ``gguf`` package).
`convert_gguf` writes a GGUF model once as a safetensors directory, which then loads in about a second.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iwg_worker.model_dir import TOKENIZER_FILES, missing_parts


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model directory, and the GGUF file inside it when the weights are one (else None)."""

    directory: Path
    gguf_file: str | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.gguf_file is not None or any((self.directory / n).is_file() for n in TOKENIZER_FILES)

    def pretrained_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def model_source(path: str | Path) -> ModelSource:
    """Check that ``path`` holds a model and say how to load it; ValueError naming what is missing."""
    root = Path(path)
    if root.is_file() and root.suffix == ".gguf":
        return ModelSource(root.parent, root.name)
    missing = missing_parts(root, "generate")
    if missing:
        raise ValueError(f"model path {str(root)!r} cannot be loaded: {'; '.join(missing)}")
    return ModelSource(root)


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> Any:
    """The model's tokenizer; ``chat_template`` (spec.model.chatTemplate) replaces the template it ships."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.pretrained_kwargs())
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_causal_lm(source: ModelSource, dtype: Any, **kwargs: Any) -> Any:
    """The model, on CPU, in ``dtype`` (the caller moves it); extra keyword arguments go to from_pretrained."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=dtype, **source.pretrained_kwargs(), **kwargs
    )


def readable_by_all(directory: Path) -> None:
    """Makes the files of a model directory readable by every user, as the umask would have left them: the
    workers run as an unprivileged user (uid 65532), and safetensors writes its file owner-only (0600)."""
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(path.stat().st_mode | 0o444)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantise a GGUF causal LM once into a safetensors model directory (model, tokenizer, chat template)."""
    source = model_source(gguf_path)
    if source.gguf_file is None:
        raise ValueError(f"{str(gguf_path)!r} is not a GGUF file")
    out = Path(out_dir)
    tokenizer = load_tokenizer(source)
    model = load_causal_lm(source, dtype=None)
    # A GGUF-loaded model refuses save_pretrained while it still names its quantizer; its weights are already
    # dequantised, so the quantizer has nothing left to do.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted conversion
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    readable_by_all(partial)
    partial.rename(out)
    return out
