"""`RequestStream` alone, with SmolLM2's real tokenizer: text deltas decoded a window at a time join to the
text of the whole output, multi-byte characters split over tokens included, at a cost per step that does not
grow with the output."""

from __future__ import annotations

from typing import Any

import pytest
from iwg_worker.engine.requests import GenerationRequest, SamplingParams
from iwg_worker.engine.streams import DECODE_WINDOW, RequestStream
from iwg_worker.models.loading import load_tokenizer, model_source

from tests.models import smollm2_dir

TEXT = (
    "Kubernetes schedules pods. Les réseaux neuronaux décodent des jetons — 推理服务器 streams tokens 🚀🤖, "
    "and the operator replaces what fails: ñandú, Ελληνικά, 日本語のテキスト. "
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(model_source(smollm2_dir()))


def test_deltas_decoded_a_window_at_a_time_join_to_the_whole_text(tokenizer: Any) -> None:
    ids = tokenizer(TEXT * 8, add_special_tokens=False)["input_ids"]
    decoded_tokens = 0

    def decode(tokens: list[int]) -> str:
        nonlocal decoded_tokens
        decoded_tokens += len(tokens)
        return str(tokenizer.decode(tokens, skip_special_tokens=True))

    stream = RequestStream(
        GenerationRequest("r", (1,), SamplingParams(max_tokens=len(ids))), decode, frozenset({0})
    )
    parts = []
    for n in range(1, len(ids) + 1):
        item, _ = stream.update(ids[:n], n == len(ids), None)
        if item is not None:
            parts.append(item["text"])
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(1, 40))  # characters split over tokens
    # Each step decodes a window of the newest tokens, not the whole output again.
    assert decoded_tokens < (2 * DECODE_WINDOW + 8) * len(ids), (decoded_tokens, len(ids))
