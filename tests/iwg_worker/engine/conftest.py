"""SmolLM2-135M-Instruct (real weights) in an in-process `GenerationEngine`, and a collector of its items."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from iwg_worker.engine.engine import EngineConfig, GenerationEngine
from iwg_worker.engine.vllm_engine import VllmEngine
from iwg_worker.models.loading import load_causal_lm, load_tokenizer, model_source

from tests.models import smollm2_dir

Engine = GenerationEngine | VllmEngine


class Collector:
    """The sink of an engine: every request's items, and a wait until requests have finished."""

    def __init__(self) -> None:
        self.items: dict[str, list[dict[str, Any]]] = {}
        self.messages = 0
        self._cond = threading.Condition()

    def __call__(self, items: list[dict[str, Any]]) -> None:
        with self._cond:
            self.messages += 1
            for item in items:
                self.items.setdefault(item["id"], []).append(item)
            self._cond.notify_all()

    def done(self, request_id: str) -> bool:
        got = self.items.get(request_id, [])
        return bool(got) and (got[-1]["finish_reason"] is not None or got[-1]["error"] is not None)

    def wait(self, request_ids: list[str], timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(self.done(r) for r in request_ids):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"not finished: {[r for r in request_ids if not self.done(r)]}"
                self._cond.wait(remaining)

    def wait_tokens(self, request_id: str, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.tokens(request_id).__len__() < count:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"{request_id} produced {len(self.tokens(request_id))} tokens"
                self._cond.wait(remaining)

    def tokens(self, request_id: str) -> list[int]:
        return [t for item in self.items.get(request_id, []) for t in item["tokens"]]

    def text(self, request_id: str) -> str:
        return "".join(item["text"] for item in self.items.get(request_id, []))

    def finish(self, request_id: str) -> str | None:
        return self.items[request_id][-1]["finish_reason"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> tuple[Any, Any]:
    """transformers' own model and tokenizer on the same weights (the oracle)."""
    source = model_source(smollm2)
    return load_causal_lm(source, torch.float32).eval(), load_tokenizer(source)


def make_engine(path: Path, **config: Any) -> tuple[GenerationEngine, Collector]:
    source = model_source(path)
    model = load_causal_lm(source, torch.float32, attn_implementation="sdpa").eval()
    engine = GenerationEngine(model, load_tokenizer(source), EngineConfig(**config), 4 * 1024**3)
    collector = Collector()
    engine.set_sink(collector)
    return engine, collector


def make_vllm_engine(path: Path) -> tuple[VllmEngine, Collector]:
    """vLLM's engine in this process, eager (no compile warm-up), float32 like the transformers engine here."""
    from iwg_worker.engine.choice import cpu_budget
    from iwg_worker.engine.vllm_engine import VllmEngine, VllmOptions, prepare_environment

    prepare_environment("cpu", cpu_budget())
    options = VllmOptions(
        dtype="float32", device_type="cpu", enforce_eager=True, available_memory=4 * 1024**3
    )
    engine = VllmEngine(str(path), load_tokenizer(model_source(path)), EngineConfig(), options)
    collector = Collector()
    engine.set_sink(collector)
    return engine, collector


def release_vllm() -> None:
    """What vLLM's in-process engine leaves in this process: its process group, and torch.set_num_threads,
    which its CPU worker replaces with a no-op."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    torch.set_num_threads = _SET_NUM_THREADS


_SET_NUM_THREADS = torch.set_num_threads


def make_vllm_engine_in_a_fresh_cache(path: Path, cache: Path) -> tuple[VllmEngine, Collector]:
    """make_vllm_engine with an empty VLLM_CACHE_ROOT, as in a new pod (its $HOME an emptyDir): the engine
    inspects the model's class in this process (inspect_model_classes_here), so vLLM asks no subprocess to."""
    from vllm import envs
    from vllm.model_executor.models import registry

    asked: list[str] = []
    runner = registry._run_in_subprocess

    def recorded(fn: Any) -> Any:
        asked.append(repr(fn))
        return runner(fn)

    with pytest.MonkeyPatch.context() as patch:
        envs.disable_envs_cache()  # an engine built earlier in this process may have frozen vLLM's environment
        patch.setenv("VLLM_CACHE_ROOT", str(cache))
        patch.setattr(registry, "_run_in_subprocess", recorded)
        built = make_vllm_engine(path)
    assert not asked, f"vLLM inspected the model class in a subprocess: {asked}"
    assert list((cache / "modelinfos").glob("*LlamaForCausalLM.json")), "no inspection cached"
    return built


@pytest.fixture(scope="session", params=["transformers", "vllm"])
def engine(
    request: pytest.FixtureRequest, smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Collector]]:
    """Each generation engine in turn, on the same weights: every test that takes it runs on both. One of each
    for the session (pytest runs the tests of one engine, then the other's): a vLLM start costs a minute here."""
    eng: Engine
    if request.param == "vllm":
        eng, collector = make_vllm_engine_in_a_fresh_cache(smollm2, tmp_path_factory.mktemp("vllm-cache"))
    else:
        eng, collector = make_engine(smollm2, num_blocks=256, max_batch_tokens=1024)
    yield eng, collector
    eng.shutdown()
    if request.param == "vllm":
        release_vllm()


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
