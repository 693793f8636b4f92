"""The driver's body parsing (`app._parse`) in process: the look for lone surrogates, and when it is skipped."""

from __future__ import annotations

import json
from typing import Any

import pytest
from iwg_worker.driver import app
from iwg_worker.driver.openai_api import ApiError, CompletionRequest, EmbeddingRequest

BAD = {"model": "m", "input": ["fine", "broken \ud800 text"]}


class _Body:
    """What `_parse` reads of an aiohttp request: its body."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


async def parse(raw: bytes, model: Any = EmbeddingRequest) -> Any:
    return await app._parse(_Body(raw), model)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
async def test_a_lone_surrogate_is_refused_naming_its_field_in_every_encoding_json_takes(
    encoding: str,
) -> None:
    # UTF-16 and UTF-32 spell the \uD800 escape with NUL bytes between its characters, where the quick look for
    # the escape finds nothing: such a body is always walked.
    with pytest.raises(ApiError) as info:
        await parse(json.dumps(BAD).encode(encoding))
    assert info.value.status == 400
    assert info.value.body()["error"]["param"] == "input[1]"


async def test_a_body_without_a_surrogate_escape_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[Any] = []
    monkeypatch.setattr(app, "_check_strings", lambda value, path: walked.append(value))
    request = await parse(
        json.dumps({"model": "m", "prompt": list(range(1, 4097))}).encode(), CompletionRequest
    )
    assert len(request.prompt) == 4096 and walked == []
    # An escaped backslash before "ud800" is no surrogate, but looks like one: walked, and accepted.
    request = await parse(json.dumps({"model": "m", "prompt": "a\\ud800"}).encode(), CompletionRequest)
    assert request.prompt == "a\\ud800" and len(walked) == 1
