"""A generation worker whose engine costs nothing, for measuring what the driver and the wire add.

`bench.driver_overhead` runs it behind a real driver (``spec.worker.workerCls: bench.instant_worker.InstantWorker``
in the wiring environment): requests are checked by the real `parse_request`, answered by ``engine_add`` as
the real engines answer them, and streamed through the real `WorkerProc` output path, one sink call per step
for every open request, as the engines do. What is not real is the model: a request's first token is emitted
the moment its engine sees it (no prefill: sent from ``engine_add`` itself, just before its answer), then one
token every ``IWG_BENCH_STEP_MS`` milliseconds (default
20), and each token's text is the ``time.monotonic_ns()`` at which it was emitted (CLOCK_MONOTONIC, the same
clock in every process of this machine), so a client can tell how long each token took to reach it.

Not a test double for anything the tests check: the tests run the real engines. It exists so that a benchmark
can subtract the engine from a request's latency.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iwg_worker.engine.requests import ModelLimits, RequestRejected, parse_request
from iwg_worker.worker_base import WorkerBase, WorkerConfig

STEP_ENV = "IWG_BENCH_STEP_MS"
LIMITS = ModelLimits(context_length=8192, vocab_size=49152)
BLOCK_SIZE = 64


@dataclass
class _Open:
    remaining: int
    sent: int = 0


class InstantWorker(WorkerBase):
    """One rank of a replica whose engine emits tokens without computing them (see the module's text)."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.step_s = float(os.environ.get(STEP_ENV, "20")) / 1000.0
        self._sink: Callable[[list[dict[str, Any]]], None] | None = None
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0

    def init_device(self) -> None:
        pass

    def load_model(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="instant-engine", daemon=True)
        self._thread.start()

    def execute_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        raise TypeError("a generate worker streams: send requests with engine_add, not execute_model")

    def get_memory_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 30

    def check_health(self) -> dict[str, Any]:
        running = self._thread is not None and self._thread.is_alive()
        return {
            "device": "cpu",
            "device_available": running,
            "cpu": True,
            "model_loaded": running,
            "engine_running": running,
            "task": "generate",
            "engine": "instant",
            "steps": self.steps,
        }

    def set_stream_sink(self, sink: Callable[[list[dict[str, Any]]], None]) -> None:
        self._sink = sink

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()

    def describe(self) -> dict[str, Any]:
        return {
            "task": "generate",
            "served_name": self.config.served_name,
            "replica": self.config.replica,
            "rank": self.config.rank,
            "world_size": self.config.world_size,
            "device": "cpu",
            "dtype": "none",
            "parameter_bytes": 0,
        }

    # -- the engine interface the driver calls -----------------------------------------------------------

    def engine_add(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        answers: list[dict[str, Any]] = []
        admitted: list[str] = []
        for raw in requests:
            request_id = raw.get("id") if isinstance(raw, dict) else None
            try:
                request = parse_request(raw, LIMITS, None)
            except RequestRejected as exc:
                answers.append({"id": request_id, "ok": False, "error": exc.as_dict()})
                continue
            with self._lock:
                self._open[request.request_id] = _Open(request.params.max_tokens)
                admitted.append(request.request_id)
            answers.append({"id": request.request_id, "ok": True, "prompt_tokens": len(request.prompt_ids)})
        # The first tokens at once, from this thread (the one the call came on): no engine thread to wake.
        with self._lock:
            stamp = time.monotonic_ns()
            items = [self._item(i, stamp) for i in admitted if i in self._open]
        if items and self._sink is not None:
            self._sink(items)
        self._wake.set()
        return answers

    def engine_cancel(self, request_ids: list[str]) -> int:
        with self._lock:
            return sum(self._open.pop(r, None) is not None for r in request_ids)

    def engine_stats(self) -> dict[str, Any]:
        with self._lock:
            running = len(self._open)
        return {
            "requests_running": running,
            "requests_waiting": 0,
            "streams": running,
            "kv_cache_blocks_used": 0,
            "kv_cache_blocks_total": 1,
            "kv_cache_usage": 0.0,
            "block_size": BLOCK_SIZE,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_evictions": 0,
            "structured_outputs": None,
            "tool_call_format": None,
            "engine_running": True,
        }

    # -- the engine's thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        """A decode step every ``step_s`` while requests are open: one token for each, one sink call."""
        while not self._stopping:
            with self._lock:
                idle = not self._open
            if idle:
                self._wake.wait()
                self._wake.clear()
                next_step = time.monotonic() + self.step_s
                continue
            time.sleep(max(0.0, next_step - time.monotonic()))
            next_step += self.step_s
            with self._lock:
                stamp = time.monotonic_ns()
                items = [self._item(i, stamp) for i in list(self._open)]
            if items and self._sink is not None:
                self.steps += 1
                self._sink(items)

    def _item(self, request_id: str, stamp: int) -> dict[str, Any]:
        """The next token of an open request (under the lock); its text is when it was emitted."""
        state = self._open[request_id]
        state.sent += 1
        state.remaining -= 1
        finished = state.remaining <= 0
        if finished:
            del self._open[request_id]
        return {
            "id": request_id,
            "tokens": [state.sent],
            "text": f"{stamp} ",
            "logprobs": None,
            "token_texts": None,
            "top_logprobs": None,
            "finish_reason": "length" if finished else None,
            "error": None,
        }
