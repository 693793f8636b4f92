"""Schema checks before a request reaches a batch, and tool calls read back from constrained text (no engine)."""

from __future__ import annotations

import json

import pytest
from iwg_worker.driver.structured import Constraint, ToolCallReader
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
    assert reader.feed('[{"name":"f","parameters":{"a":') == []
    first = reader.feed('1}},{"name":"g",')
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in first] == [
        (0, "f", '{"a": 1}')
    ]
    second = reader.feed('"parameters":{}}]')
    assert [(c["index"], c["function"]["name"]) for c in second] == [(1, "g")]
    assert first[0]["id"] != second[0]["id"] and first[0]["id"].startswith("call_")
