"""Both generation engines (transformers' continuous batching and vLLM's, each test run on each) on
SmolLM2-135M-Instruct (real weights), checked against transformers' own `generate` on the same weights:
concurrent greedy decoding, seeded sampling, stop rules, logprobs, requests refused alone, a full KV cache,
cancellation. vLLM's own `LLM.generate` is the oracle of tests/iwg_worker/driver/test_vllm_serve.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from iwg_worker.engine.front import render_chat

from tests.iwg_worker.engine.conftest import Collector, Engine, chat_ids, make_engine

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

QUESTIONS = [
    "What is the capital of France?",
    "Name a colour.",
    "Write one sentence about the sea and the ships that sail on it, and the people who wait for them.",
    "What is 2 + 2?",
    "Give me three fruits.",
    "Why is the sky blue? Answer briefly, as if to a child who keeps asking why.",
    "Say hello.",
    "What do cats eat?",
    "List the days of the week in order, starting with Monday, separated by commas.",
    "Translate 'good morning' to French.",
    "Who wrote Hamlet?",
    "Describe a tree in a few words.",
    "What is the boiling point of water at sea level in degrees Celsius, and why does it change on a mountain?",
    "Count from one to five.",
    "Is the moon a planet?",
    "What is a prime number? Give an example and explain in one line why it is prime.",
]


def greedy_reference(reference: tuple[Any, Any], prompt: list[int], max_tokens: int) -> list[int]:
    model, tokenizer = reference
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def add(engine: Engine, *requests: dict[str, Any]) -> list[dict[str, Any]]:
    return engine.add(list(requests))


def test_greedy_tokens_of_16_concurrent_prompts_equal_transformers_generate(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    eng, collector = engine
    prompts = [chat_ids(reference[1], q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 8  # prompts of different lengths
    ids = [f"oracle-{i}" for i in range(len(prompts))]
    before = collector.messages
    answers = add(
        eng,
        *(
            {"id": i, "prompt_ids": p, "max_tokens": 12, "temperature": 0.0}
            for i, p in zip(ids, prompts, strict=False)
        ),
    )
    assert all(a["ok"] for a in answers), answers
    collector.wait(ids)
    # Batched: 16 requests in far fewer messages than tokens (one message per engine step for all of them).
    total_tokens = sum(len(collector.tokens(i)) for i in ids)
    assert collector.messages - before < total_tokens / 4
    for request_id, prompt in zip(ids, prompts, strict=True):
        expected = greedy_reference(reference, prompt, 12)
        assert collector.tokens(request_id) == expected, request_id
        assert collector.text(request_id) == reference[1].decode(expected, skip_special_tokens=True)
        # An end-of-sequence token stops the request, also when it is the last one allowed.
        assert collector.finish(request_id) == ("stop" if expected[-1] in eng.eos_token_ids else "length")


def test_prompts_sharing_a_long_prefix_reuse_its_cache_and_decode_as_generate_does(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    """Prefix caching on: a later prompt's leading full blocks come from an earlier request's cache (the engine
    counts them as hits), and its greedy tokens are still transformers' own."""
    eng, collector = engine
    system = "You answer briefly. " + " ".join(f"Rule {i}: use plain words, no lists." for i in range(30))
    prompts = [
        render_chat(reference[1], [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in QUESTIONS[:4]
    ]
    shared = next(i for i, tokens in enumerate(zip(*prompts, strict=False)) if len(set(tokens)) > 1)
    block = int(eng.stats()["block_size"])
    assert shared >= 2 * block  # at least two full blocks in common
    before = eng.stats()
    add(eng, {"id": "prefix-0", "prompt_ids": prompts[0], "max_tokens": 8, "temperature": 0.0})
    collector.wait(["prefix-0"])
    ids = [f"prefix-{i}" for i in range(1, len(prompts))] + ["prefix-again"]
    add(
        eng,
        *(
            {"id": i, "prompt_ids": p, "max_tokens": 8, "temperature": 0.0}
            for i, p in zip(ids, [*prompts[1:], prompts[0]], strict=True)
        ),
    )
    collector.wait(ids)
    expected = [greedy_reference(reference, prompt, 8) for prompt in prompts]
    for request_id, tokens in zip(["prefix-0", *ids], [*expected, expected[0]], strict=True):
        assert collector.tokens(request_id) == tokens, request_id
    deadline = time.monotonic() + 10  # vLLM's counts arrive with its stat logger, after the step
    while True:
        after = eng.stats()
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        if hits >= len(ids) * (shared // block) * block or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert hits >= len(ids) * (shared // block) * block
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] >= sum(map(len, prompts)) + len(
        prompts[0]
    )


def test_the_france_question_is_answered_paris(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    eng, collector = engine
    prompt = chat_ids(reference[1], "What is the capital of France?")
    assert add(eng, {"id": "france", "prompt_ids": prompt, "max_tokens": 20, "temperature": 0.0})[0]["ok"]
    collector.wait(["france"])
    assert collector.text("france").strip() == "The capital of France is Paris."
    assert collector.finish("france") == "stop"  # the model's end-of-turn token, not the length limit


def test_seeded_sampling_is_reproducible_whatever_it_is_batched_with(
    engine: tuple[Engine, Collector],
) -> None:
    eng, collector = engine
    sampled = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50}
    add(eng, {"id": "seed-alone", "seed": 1234, **sampled})
    collector.wait(["seed-alone"])
    others = [
        {
            "id": f"seed-noise-{i}",
            "prompt": f"Tell me about number {i}.",
            "max_tokens": 10 + i,
            "temperature": 1.0,
        }
        for i in range(5)
    ]
    add(eng, others[0], others[1], {"id": "seed-crowd", "seed": 1234, **sampled}, *others[2:])
    add(eng, {"id": "seed-other", "seed": 99, **sampled})
    collector.wait(["seed-crowd", "seed-other", *(o["id"] for o in others)])
    assert collector.tokens("seed-alone") == collector.tokens("seed-crowd")
    assert collector.tokens("seed-other") != collector.tokens("seed-alone")


def test_a_stop_string_ends_generation_where_it_appears(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    eng, collector = engine
    prompt = chat_ids(reference[1], "What is the capital of France?")
    add(eng, {"id": "stop", "prompt_ids": prompt, "max_tokens": 20, "temperature": 0.0, "stop": [" France"]})
    collector.wait(["stop"])
    assert collector.text("stop") == "The capital of"
    assert collector.finish("stop") == "stop"
    # Only the tokens of the returned text are returned (and counted): "The", " capital", " of".
    assert reference[1].decode(collector.tokens("stop")) == "The capital of"


def test_logprobs_are_the_models_own(engine: tuple[Engine, Collector], reference: tuple[Any, Any]) -> None:
    eng, collector = engine
    model, tokenizer = reference
    prompt = chat_ids(tokenizer, "Say hello.")
    add(
        eng,
        {
            "id": "lp",
            "prompt_ids": prompt,
            "max_tokens": 3,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    collector.wait(["lp"])
    items = collector.items["lp"]
    logprobs = [v for item in items for v in item["logprobs"]]
    top = [row for item in items for row in item["top_logprobs"]]
    tokens = collector.tokens("lp")
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert logprobs[0] == pytest.approx(float(expected[tokens[0]]), abs=1e-3)
    assert [t for t, _, _ in top[0]] == torch.topk(expected, 3).indices.tolist()
    assert top[0][0][0] == tokens[0]  # greedy: the most likely token was chosen
    assert len(logprobs) == len(top) == len(tokens)
    # Each token is named by its own text, as the tokenizer spells it.
    texts = [t for item in items for t in item["token_texts"]]
    assert texts == [tokenizer.decode([t]) for t in tokens]
    assert [text for _, _, text in top[0]] == [tokenizer.decode([t]) for t, _, _ in top[0]]


def test_bad_requests_are_refused_alone_before_they_reach_a_batch(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    eng, collector = engine
    context = eng.limits.context_length
    good = {"id": "iso-good", "prompt": "Name a colour.", "max_tokens": 5, "temperature": 0.0}
    answers = add(
        eng,
        {"id": "iso-vocab", "prompt_ids": [1, 2, eng.limits.vocab_size]},
        {"id": "iso-long", "prompt_ids": [1] * context},
        {"id": "iso-max", "prompt": "hi", "max_tokens": context},
        {"id": "iso-temp", "prompt": "hi", "temperature": float("nan")},
        good,
        {"id": "iso-good", "prompt": "again"},  # the same id while it runs
    )
    by_id = [(a["id"], a["ok"], a.get("error", {}).get("param")) for a in answers]
    assert by_id == [
        ("iso-vocab", False, "prompt"),
        ("iso-long", False, "prompt"),
        ("iso-max", False, "max_tokens"),
        ("iso-temp", False, "temperature"),
        ("iso-good", True, None),
        ("iso-good", False, "id"),
    ]
    assert str(eng.limits.vocab_size) in answers[0]["error"]["message"]
    assert str(context) in answers[1]["error"]["message"] and str(context) in answers[2]["error"]["message"]
    collector.wait(["iso-good"])
    assert len(collector.tokens("iso-good")) >= 1
    assert not any(collector.items.get(i) for i in ("iso-vocab", "iso-long", "iso-max", "iso-temp"))


def test_a_full_kv_cache_makes_requests_wait_and_all_complete_correctly(
    smollm2: Path, reference: tuple[Any, Any]
) -> None:
    # 4 blocks of 64 tokens hold 256 tokens; 6 requests need about 6 x 60: they cannot all run at once.
    eng, collector = make_engine(smollm2, num_blocks=4, max_batch_tokens=256)
    try:
        prompts = [chat_ids(reference[1], q) for q in QUESTIONS[:6]]
        ids = [f"full-{i}" for i in range(len(prompts))]
        answers = add(
            eng,
            *(
                {"id": i, "prompt_ids": p, "max_tokens": 24, "temperature": 0.0}
                for i, p in zip(ids, prompts, strict=False)
            ),
        )
        assert all(a["ok"] for a in answers), answers
        peak_waiting = 0
        while not all(collector.done(i) for i in ids):
            peak_waiting = max(peak_waiting, eng.stats()["requests_waiting"])
            time.sleep(0.05)
        assert peak_waiting > 0  # the cache was full: some requests waited
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert collector.items[request_id][-1]["error"] is None
            assert collector.tokens(request_id) == greedy_reference(reference, prompt, 24), request_id
        assert eng.stats()["kv_cache_blocks_used"] == 0
        # A finished request's 3 full blocks stay cached; a prompt of 3 other blocks needs their room: the
        # engine drops its cached blocks, and counts it (the driver's routing table follows).
        evictions = eng.stats()["prefix_cache_evictions"]
        for name, start in (("evict-a", 1000), ("evict-b", 3000)):
            add(eng, {"id": name, "prompt_ids": list(range(start, start + 200)), "max_tokens": 2})
            collector.wait([name])
        assert eng.stats()["prefix_cache_evictions"] > evictions
    finally:
        eng.shutdown()


def test_cancelling_frees_the_cache_at_the_next_step(engine: tuple[Engine, Collector]) -> None:
    eng, collector = engine
    ids = [f"cancel-{i}" for i in range(4)]
    add(
        eng,
        *(
            {"id": i, "prompt": f"Write a long story number {n}.", "max_tokens": 400, "ignore_eos": True}
            for n, i in enumerate(ids)
        ),
    )
    for request_id in ids:
        collector.wait_tokens(request_id, 2)
    used = eng.stats()["kv_cache_blocks_used"]
    assert used >= 4
    assert eng.cancel(ids[:2]) == 2
    deadline = time.monotonic() + 30
    while eng.stats()["kv_cache_blocks_used"] >= used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert 0 < eng.stats()["kv_cache_blocks_used"] < used
    eng.cancel(ids[2:])
    while eng.stats()["kv_cache_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.stats() | {"engine_running": True} == eng.stats()
    assert eng.stats()["kv_cache_blocks_used"] == 0 and eng.stats()["requests_running"] == 0
    # Nothing more is sent for a cancelled request.
    sent = {i: len(collector.items[i]) for i in ids}
    time.sleep(0.3)
    assert {i: len(collector.items[i]) for i in ids} == sent


def test_a_stop_token_id_ends_generation_with_stop(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    eng, collector = engine
    prompt = chat_ids(reference[1], "What is the capital of France?")
    expected = greedy_reference(reference, prompt, 8)
    add(
        eng,
        {
            "id": "stop-id",
            "prompt_ids": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "stop_token_ids": [expected[2]],
        },
    )
    collector.wait(["stop-id"])
    assert collector.tokens("stop-id") == expected[:3]
    assert collector.finish("stop-id") == "stop"


def test_a_gguf_file_is_a_model_source(smollm2: Path) -> None:
    from iwg_worker.model_dir import missing_parts
    from iwg_worker.models.loading import model_source

    from tests.models import smollm2_gguf

    gguf = smollm2_gguf()
    assert model_source(gguf).gguf_file == gguf.name and model_source(gguf).directory == gguf.parent
    assert missing_parts(gguf, "generate") == []
    assert model_source(smollm2).gguf_file is None
    with pytest.raises(ValueError, match="no weights"):
        model_source(gguf.parent.parent)  # a directory without a model


def test_chat_messages_are_rendered_with_the_models_own_template(
    engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    eng, collector = engine
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answers = add(eng, {"id": "chat", "messages": messages, "max_tokens": 20, "temperature": 0.0})
    assert answers[0]["prompt_tokens"] == len(chat_ids(reference[1], messages[0]["content"]))
    collector.wait(["chat"])
    assert collector.text("chat").strip() == "The capital of France is Paris."
    refused = add(eng, {"id": "chat-bad", "messages": [{"role": "robot", "content": "hi"}]})
    assert refused[0]["ok"] is False and refused[0]["error"]["param"] == "messages[0].role"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tool_choice_auto_needs_a_template_with_tools_and_reads_the_calls_the_model_writes(
    engine: tuple[Engine, Collector],
) -> None:
    """SmolLM2's own template renders no tools: auto is refused naming tool_choice. With the Hermes template of
    examples/smollm2-tools.yaml and an earlier call in the conversation, the model writes a call to the tool
    for the new city, which the driver's reader returns as a call; asked to greet, it writes text."""
    import json

    import yaml
    from iwg_worker.driver.structured import HermesToolReader

    from tests.models import ROOT

    eng, collector = engine
    user = {"role": "user", "content": "What is the weather in Paris?"}
    auto = {"tools": [WEATHER], "tool_choice": "auto", "max_tokens": 40, "temperature": 0.0}
    refused = add(eng, {"id": "auto-refused", "messages": [user], **auto})
    assert refused[0]["ok"] is False and refused[0]["error"]["param"] == "tool_choice", refused
    assert eng.stats()["tool_call_format"] is None
    earlier = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'},
            }
        ],
    }
    own = eng.tokenizer.chat_template
    manifest = yaml.safe_load((ROOT / "examples" / "smollm2-tools.yaml").read_text())
    eng.tokenizer.chat_template = manifest["spec"]["model"]["chatTemplate"]
    try:
        assert eng.stats()["tool_call_format"] == "hermes"
        answers = add(
            eng,
            {
                "id": "auto-call",
                "messages": [{**user, "content": "What is the weather in Berlin?"}, earlier, user],
                **auto,
            },
            {"id": "auto-text", "messages": [{"role": "user", "content": "Say hello."}], **auto},
        )
    finally:
        eng.tokenizer.chat_template = own
    assert [(a["ok"], a.get("tool_call_format")) for a in answers] == [(True, "hermes")] * 2, answers
    collector.wait(["auto-call", "auto-text"])
    results = {}
    for request_id in ("auto-call", "auto-text"):
        reader = HermesToolReader(frozenset({"get_weather"}))
        reader.feed(collector.text(request_id))
        reader.close()
        results[request_id] = (
            reader.content,
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.calls],
        )
    assert results["auto-call"] == (None, [("get_weather", {"city": "Paris"})]), collector.text("auto-call")
    assert results["auto-text"][1] == [] and results["auto-text"][0], collector.text("auto-text")
