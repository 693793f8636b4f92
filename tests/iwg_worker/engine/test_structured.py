"""Schema checks before a request reaches a batch, and tool calls read back from constrained text (no engine)."""

from __future__ import annotations

import json

import pytest
from iwg_worker.driver.structured import Constraint, HermesToolReader, ToolCallReader
from iwg_worker.engine.front import tool_call_format
from iwg_worker.engine.requests import RequestRejected
from iwg_worker.engine.structured import SchemaCompiler
from iwg_worker.engine.vllm_engine import _check_vllm_schema
from iwg_worker.models.loading import load_tokenizer, model_source

from tests.models import smollm2_dir


def test_xgrammar_compiles_a_schema_and_refuses_a_broken_one_naming_the_field() -> None:
    tokenizer = load_tokenizer(model_source(smollm2_dir()))
    compiler = SchemaCompiler(tokenizer, 49152, frozenset({2}))
    assert compiler.compile(json.dumps({"type": "object"}), "response_format") is not None
    with pytest.raises(RequestRejected) as info:
        compiler.compile(json.dumps({"$ref": "#/$defs/missing"}), "tools[1].function.parameters")
    assert info.value.param == "tools[1].function.parameters" and info.value.code == "invalid_schema"
    compiler.shutdown()


def test_vllm_refuses_keywords_its_backend_does_not_enforce_naming_the_field() -> None:
    _check_vllm_schema(json.dumps({"type": "integer", "minimum": 0}), "response_format")
    for schema in ({"type": "integer", "multipleOf": 3}, {"type": "array", "uniqueItems": True}):
        with pytest.raises(RequestRejected) as info:
            _check_vllm_schema(json.dumps(schema), "response_format.json_schema.schema")
        assert info.value.param == "response_format.json_schema.schema"


def test_required_tool_calls_stream_whole_once_each_element_is_complete() -> None:
    reader = ToolCallReader(Constraint("{}", "tools", "required"))
    assert reader.feed('[{"name":"f","parameters":{"a":') == ("", [])
    _, first = reader.feed('1}},{"name":"g",')
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in first] == [
        (0, "f", '{"a": 1}')
    ]
    _, second = reader.feed('"parameters":{}}]')
    assert [(c["index"], c["function"]["name"]) for c in second] == [(1, "g")]
    assert first[0]["id"] != second[0]["id"] and first[0]["id"].startswith("call_")


# -- tool_choice auto: the Hermes format ------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def read(text: str, pieces: int) -> tuple[str, list[dict[str, object]], bool]:
    """``text`` fed to a reader in ``pieces`` parts of about equal size: the content and call deltas it
    streamed, and whether it ends as tool calls."""
    reader = HermesToolReader(frozenset({"get_weather"}))
    size = max(1, -(-len(text) // pieces))
    content, calls = "", []
    for i in range(0, len(text), size):
        more, new = reader.feed(text[i : i + size])
        content, calls = content + more, calls + new
    more, new = reader.close()
    assert (reader.content or "") == content + more
    return content + more, calls + new, reader.finish_as_tool_calls


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, "", [("get_weather", {"city": "Paris"})]),
        (f"Let me look.\n\n{CALL}\n{CALL}\n", "Let me look.", [("get_weather", {"city": "Paris"})] * 2),
        ("Just text, <b>tags</b> and a < sign.\n", "Just text, <b>tags</b> and a < sign.\n", []),
        # A call the model did not close before it stopped is still a call.
        (CALL.removesuffix("</tool_call>"), "", [("get_weather", {"city": "Paris"})]),
        # Not a call of the request's tools, or not JSON: the text stays content, as the model wrote it.
        (
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            [],
        ),
        ("<tool_call>{not json</tool_call> ok", "<tool_call>{not json</tool_call> ok", []),
        ("<tool_call>{cut", "<tool_call>{cut", []),
    ],
    ids=[
        "one call",
        "content and two calls",
        "text only",
        "unclosed call",
        "unknown tool",
        "not json",
        "cut",
    ],
)
def test_hermes_blocks_are_calls_and_the_rest_content_however_the_text_is_streamed(
    text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    for pieces in (1, 3, 7, len(text)):  # whole, in parts, a character at a time
        got_content, got_calls, as_calls = read(text, pieces)
        assert got_content == content, pieces
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
        assert [c["index"] for c in got_calls] == list(range(len(calls)))
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
        assert as_calls == bool(calls)


def test_auto_is_offered_only_where_the_template_renders_tools_as_hermes_blocks() -> None:
    import yaml

    from tests.models import ROOT

    tools_template = yaml.safe_load((ROOT / "examples" / "smollm2-tools.yaml").read_text())["spec"]["model"][
        "chatTemplate"
    ]
    assert tool_call_format(tools_template) == "hermes"
    smollm2_own = load_tokenizer(model_source(smollm2_dir())).chat_template
    assert tool_call_format(smollm2_own) is None
    assert tool_call_format(None) is None


def test_auto_keeps_the_tags_a_tokenizer_has_as_special_tokens_in_that_requests_text_only() -> None:
    """A tokenizer with <tool_call> and </tool_call> as special tokens (as some Hermes models have them): a
    tool_choice auto request's text keeps them, so the driver can find the calls; any other request's text
    skips them, as it skips every special token."""
    import dataclasses

    import yaml
    from iwg_worker.engine.front import RequestFront
    from iwg_worker.engine.requests import GenerationRequest

    from tests.models import ROOT

    tokenizer = load_tokenizer(model_source(smollm2_dir()))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.chat_template = yaml.safe_load((ROOT / "examples" / "smollm2-tools.yaml").read_text())["spec"][
        "model"
    ]["chatTemplate"]

    class Front(RequestFront):
        is_driver = True

        def _admit(self, request: GenerationRequest) -> None:
            pass

    front = Front()
    front.tokenizer, front.eos_token_ids = tokenizer, frozenset({2})
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    ids = list(tokenizer(call, add_special_tokens=False)["input_ids"])
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # one special token, not its characters
    plain = GenerationRequest("plain", (1,))
    auto = front._with_tools(dataclasses.replace(plain, request_id="auto", tools_auto=True))
    texts = {}
    for request in (plain, auto):
        item, _ = front._stream(request).update(ids, True, None)
        assert item is not None
        texts[request.request_id] = item["text"]
    assert texts == {"plain": '{"name": "get_weather", "arguments": {}}', "auto": call}
