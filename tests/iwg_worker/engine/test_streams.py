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


@pytest.mark.parametrize(
    ("ignore_eos", "stop_token_ids", "finish"),
    [
        (False, (), "stop"),  # the EOS ended it
        (True, (), "length"),  # the EOS was just a token: max_tokens ended it
        (True, (7,), "stop"),  # a stop token the request named ends it, EOS ignored or not
    ],
)
def test_the_finish_reason_of_a_request_whose_last_token_ends_sequences(
    ignore_eos: bool, stop_token_ids: tuple[int, ...], finish: str
) -> None:
    last = stop_token_ids[0] if stop_token_ids else 0  # 0: the engine's EOS here
    params = SamplingParams(max_tokens=3, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
    stream = RequestStream(GenerationRequest("r", (1,), params), lambda ids: "x" * len(ids), frozenset({0}))
    item, _ = stream.update([5, 6, last], True, None)
    assert item is not None and item["finish_reason"] == finish
