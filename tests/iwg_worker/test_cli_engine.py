"""`iwg serve`'s start line names the generation engine each replica resolved (no worker processes here: a fake
executor answers the health calls), and the model's engine options reach its workers' config."""

from __future__ import annotations

from typing import Any

import pytest
from iwg_operator.api import wiring
from iwg_operator.api.v1alpha1 import load_manifest
from iwg_worker import cli
from iwg_worker.cli import _engine_words
from iwg_worker.executor import multiproc
from iwg_worker.executor.base import RPCTimeoutError


class HealthOnly:
    """Answers `check_health(replica=r)` with rank 0's report, or raises what a silent replica raises."""

    def __init__(self, *engines: object) -> None:
        self.engines = engines

    def check_health(self, timeout: float, replica: int) -> list[dict[str, Any]]:
        engine = self.engines[replica]
        if isinstance(engine, Exception):
            raise engine
        return [{"device": "cpu"} if engine is ... else {"device": "cpu", "engine": engine}]


def test_the_engine_every_replica_resolved() -> None:
    assert _engine_words(HealthOnly("vllm", "vllm"), 2, "auto") == "engine vllm"
    assert _engine_words(HealthOnly("transformers"), 1, "transformers") == "engine transformers"


def test_replicas_that_differ_are_named_one_by_one() -> None:
    words = _engine_words(HealthOnly("vllm", "transformers"), 2, "auto")
    assert words == "engines replica 0 vllm, replica 1 transformers"


def test_a_replica_that_does_not_say_leaves_the_requested_choice() -> None:
    assert _engine_words(HealthOnly("vllm", ...), 2, "auto") == "engine auto requested"  # an older worker
    assert _engine_words(HealthOnly(None), 1, "vllm") == "engine vllm requested"
    silent = RPCTimeoutError("check_health", [(0, 0)], 10.0)
    assert _engine_words(HealthOnly(silent), 1, "auto") == "engine auto requested"


@pytest.mark.parametrize("eager", [True, False])
def test_enforce_eager_reaches_the_workers_config_and_env(
    monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:
    started: list[Any] = []

    class Recorder:
        def __init__(self, config: Any, **_: Any) -> None:
            started.append(config)

    monkeypatch.setattr(multiproc, "MultiprocExecutor", Recorder)
    group = load_manifest(
        {
            "apiVersion": "inference.iwg.dev/v1alpha1",
            "kind": "InferenceWorkerGroup",
            "metadata": {"name": "g"},
            "spec": {"model": {"task": "generate", "path": "/m", "engine": "vllm", "enforceEager": eager}},
        }
    )
    args = cli._parser().parse_args(["serve", "g.yaml"])
    cli._start_workers(group, "/m", 1, args)
    (config,) = started
    assert config.enforce_eager is eager
    env = multiproc.worker_env(config, rpc_endpoint="ipc://a", response_endpoint="ipc://b")
    assert env.get(wiring.ENFORCE_EAGER) == ("1" if eager else None)
