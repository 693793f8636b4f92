"""tool_choice ``auto`` through `iwg serve` of examples/smollm2-tools.yaml (SmolLM2 with a chat template that
renders the tools and asks for Hermes ``<tool_call>`` blocks) and the official `openai` client: the calls the
model writes come back as ``tool_calls``, plain and streamed alike, and its text as content. Both engines'
rendering and output are checked in tests/iwg_worker/engine/test_engine.py; this is the driver's side."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.iwg_worker.driver.conftest import Served, start_smollm2, stop, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-tools"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A 135M model calls a tool when the conversation shows it one call first (docs/driver.md).
ASKED: Any = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'},
            }
        ],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_smollm2(
        tmp_path_factory.mktemp("serve-tools"),
        {**subprocess_env(), "OMP_NUM_THREADS": "2"},
        example="smollm2-tools.yaml",
    )
    try:
        yield served
    finally:
        code = stop(served.process)
        assert code == 0, served.log.read_text(errors="replace")[-3000:]


def streamed_calls(chunks: list[Any]) -> tuple[str, list[tuple[str, str, str]]]:
    """The content and the (id, name, arguments) of the calls a streamed chat completion sent."""
    content, calls = "", {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", ""])
            entry[0] += call.id or ""
            entry[1] += (call.function.name or "") if call.function else ""
            entry[2] += (call.function.arguments or "") if call.function else ""
    return content, [(i, n, a) for i, n, a in calls.values()]


def test_auto_returns_the_call_the_model_writes_plain_and_streamed(served: Served) -> None:
    from openai import OpenAI

    api = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for options in ({"tool_choice": "auto"}, {}):  # auto is the default with tools
        plain = api.chat.completions.create(
            model=MODEL, messages=ASKED, tools=[WEATHER], max_tokens=40, temperature=0, **options
        )
        answer = plain.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        calls = answer.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        chunks = list(
            api.chat.completions.create(
                model=MODEL,
                messages=ASKED,
                tools=[WEATHER],
                max_tokens=40,
                temperature=0,
                stream=True,
                **options,
            )
        )
        content, streamed = streamed_calls(chunks)
        assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments) for c in calls]
        assert streamed[0][0].startswith("call_")

    # The call and its result go back through the template; the model answers (text or another call).
    result: Any = [
        *ASKED,
        {"role": "assistant", "tool_calls": [c.model_dump(exclude_none=True) for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"},
    ]
    after = api.chat.completions.create(
        model=MODEL, messages=result, tools=[WEATHER], max_tokens=24, temperature=0
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage is not None and after.usage.prompt_tokens > plain.usage.prompt_tokens  # type: ignore[union-attr]


def test_auto_returns_text_as_content_when_the_model_calls_nothing(served: Served) -> None:
    from openai import OpenAI

    api = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    hello: Any = [{"role": "user", "content": "Say hello."}]
    options: Any = {"tools": [WEATHER], "max_tokens": 16, "temperature": 0}
    plain = api.chat.completions.create(model=MODEL, messages=hello, **options)
    answer = plain.choices[0]
    assert answer.message.tool_calls is None and answer.message.content, answer
    assert answer.finish_reason in ("stop", "length")
    chunks = list(api.chat.completions.create(model=MODEL, messages=hello, stream=True, **options))
    content, streamed = streamed_calls(chunks)
    assert content == answer.message.content and streamed == []
    assert chunks[-1].choices[0].finish_reason == answer.finish_reason


def test_auto_with_a_json_response_format_is_a_400_naming_it(served: Served) -> None:
    import openai
    from openai import OpenAI

    api = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=MODEL,
            messages=ASKED,
            tools=[WEATHER],
            response_format={"type": "json_object"},
            max_tokens=8,
        )
    assert info.value.body["param"] == "response_format", info.value.body  # type: ignore[index]
