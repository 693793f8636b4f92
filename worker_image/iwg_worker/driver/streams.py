"""Generation requests at the driver: each one streamed from one replica's engine, token by token.

`GenerationService.stream` picks a serving replica (`Router.pick_generation`: the one expected to hold the
longest prefix of the prompt, bounded by load; or the fewest open requests, this driver's and other drivers'
as the engine last reported them, with policy ``leastLoaded``), starts the request on its engine and yields
the engine's items as they come. What may happen to a request:

- the engine refuses it (prompt beyond the context, a token id outside the vocabulary, ...): `ApiError` 400
  naming the field, for this request alone;
- its replica fails before the request produced anything: it is started again on another replica, once
  (``iwg_request_retries_total{reason}``), or fails with 503 and ``Retry-After`` when no other replica serves.
  A replica failure is the executor losing the replica (a rank's process or heartbeats gone), or the worker
  saying so: a failed item whose ``error_code`` is ``replica_failure`` (its engine failed as a whole, e.g. an
  all-reduce whose peer rank died, which often arrives before the executor notices the rank is gone), or an
  answer refusing with code ``unavailable`` (its engine stopped). Any other engine error is this request's
  own: a 500, not retried;
- its replica dies after it produced tokens: it fails with a clear error (tokens a client has seen cannot be
  taken back, so it is not silently restarted elsewhere);
- its deadline passes, or its reader goes away (client disconnected, the handler was cancelled): it is
  cancelled on the worker, which frees its KV cache at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.openai_api import ApiError, no_replica_error
from iwg_worker.driver.pool import BatchFailure, ReplicaFailure, ReplicaPool
from iwg_worker.driver.prefix import prompt_blocks
from iwg_worker.driver.router import Router

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0
_ids = itertools.count(1)
_PREFIX = f"g{os.getpid():x}-{int(time.time()):x}"


class StreamInterrupted(Exception):
    """The request had already produced output when it failed; what was sent stands, the rest is lost."""


@dataclass(slots=True)
class StreamUsage:
    """Counts of one generation request, filled in while it streams."""

    prompt_tokens: int = 0
    prompt_text: str | None = None  # the prompt as the worker decoded it, when the request asked for echo
    tool_call_format: str | None = None  # tool_choice auto: the format the worker's model calls tools in
    completion_tokens: int = 0
    finish_reason: str | None = None


class GenerationService:
    def __init__(
        self,
        pool: ReplicaPool,
        router: Router,
        metrics: DriverMetrics,
        timeout_s: float,
        no_replica_wait_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.timeout_s = timeout_s
        # How long a request that finds no replica serving waits for one: the router's grace, or with activation
        # the activation timeout (the replica the activator saw serving may have left before the request got
        # here: the last one of a scale to zero, and one starts again for this request).
        self.no_replica_wait_s = router.no_replica_grace_s if no_replica_wait_s is None else no_replica_wait_s
        self.active = 0  # requests admitted and not yet ended
        # per replica: its engine's prefix-cache (queries, hits, evictions)
        self._prefix_counts: dict[int, tuple[int, int, int]] = {}
        # per replica: [epoch, seq] of the last report of its prefix blocks read (vLLM's engine)
        self._blocks_seen: dict[int, list[int]] = {}

    async def stream(self, request: dict[str, Any], usage: StreamUsage) -> AsyncGenerator[dict[str, Any]]:
        """The request's items in order; `ApiError` when it cannot run, `StreamInterrupted` mid-way."""
        self.active += 1
        try:
            async with contextlib.aclosing(self._stream(request, usage)) as items:
                async for item in items:
                    yield item
        finally:
            self.active -= 1

    async def _stream(self, request: dict[str, Any], usage: StreamUsage) -> AsyncGenerator[dict[str, Any]]:
        request = {**request, "id": f"{_PREFIX}-{next(_ids)}"}
        started = time.monotonic()
        deadline = started + self.timeout_s
        tried: frozenset[int] = frozenset()
        last_error: ReplicaFailure | None = None
        blocks = (
            prompt_blocks(request, self.router.block_size) if self.router.policy == "cacheAware" else None
        )
        if (
            blocks is not None and blocks.hashes
        ):  # the engine reports them stored and evicted (engine.kv_events)
            request["prefix_blocks"] = list(blocks.hashes)
        for _attempt in range(2):
            replica = self.router.pick_generation(blocks, tried)
            if replica is None and not tried:
                await self.router.wait_for_serving(self.no_replica_wait_s)
                replica = self.router.pick_generation(blocks, tried)
            if replica is None:
                break
            if last_error is not None:  # the first replica failed before any output: this is the retry
                log.warning("retrying a generation request on replica %d after: %s", replica, last_error)
                self.metrics.request_retries.labels(reason=last_error.reason).inc()
            tried = tried | {replica}
            with self.router.claim(replica):
                try:
                    items, answer = await self.pool.open_stream(replica, request, CONTROL_TIMEOUT_S)
                except ReplicaFailure as exc:
                    last_error = exc
                    self.metrics.replica_failures.labels(replica=str(replica)).inc()
                    continue
                if not answer.get("ok"):
                    error = answer.get("error") or {}
                    if error.get("code") == "unavailable":  # its engine stopped or failed: not the request's
                        last_error = ReplicaFailure(
                            f"replica {replica}: {error.get('message', 'its engine is unavailable')}",
                            reason="engine_unavailable",
                        )
                        self.metrics.replica_failures.labels(replica=str(replica)).inc()
                        continue
                    raise ApiError(
                        400,
                        f"{error.get('message', 'the request was refused')}.",
                        param=error.get("param"),
                        code=error.get("code"),
                    )
                usage.prompt_tokens = int(answer.get("prompt_tokens", 0))
                if isinstance(answer.get("prompt_text"), str):
                    usage.prompt_text = answer["prompt_text"]
                if isinstance(answer.get("tool_call_format"), str):
                    usage.tool_call_format = answer["tool_call_format"]
                produced = False
                finished = False
                try:
                    last_at = started
                    async with asyncio.timeout(deadline - time.monotonic()):
                        async for item in items:
                            now = time.monotonic()
                            if not produced:
                                self.metrics.time_to_first_token.observe(now - started)
                            elif item["tokens"]:
                                self.metrics.inter_token_latency.observe(
                                    (now - last_at) / len(item["tokens"])
                                )
                            last_at = now
                            produced = True
                            usage.completion_tokens += len(item["tokens"])
                            usage.finish_reason = item["finish_reason"]
                            finished = item["finish_reason"] is not None
                            yield item
                    return
                except TimeoutError:
                    raise self._timeout(produced) from None
                except ReplicaFailure as exc:
                    self.metrics.replica_failures.labels(replica=str(replica)).inc()
                    if produced:
                        raise StreamInterrupted(
                            f"replica {replica} failed after this request produced output: {exc}"
                        ) from None
                    last_error = exc
                    self.metrics.retries.inc()
                    continue
                except BatchFailure as exc:
                    if produced:
                        raise StreamInterrupted(str(exc)) from None
                    raise ApiError(
                        500, f"The model failed on this request: {exc}", type="server_error"
                    ) from None
                finally:
                    if not finished:
                        await _shielded(self.pool.cancel_streams(replica, [request["id"]], CONTROL_TIMEOUT_S))
        if last_error is None:
            raise no_replica_error(self.router.no_replica_grace_s)
        raise ApiError(
            503,
            f"No replica could serve this request: {last_error}.",
            type="service_unavailable",
            code="replica_failure",
            headers={"Retry-After": "1"},
        )

    def _timeout(self, produced: bool) -> Exception:
        message = f"The request did not complete within {self.timeout_s:g} s."
        if produced:
            return StreamInterrupted(message)
        return ApiError(504, message, type="timeout", code="timeout")

    async def poll_stats(self, interval_s: float = 1.0) -> None:
        """Export the engines' counts (requests running and waiting, KV cache usage, prefix-cache queries and
        hits) every ``interval_s``."""
        while True:
            await self.poll_once()
            await asyncio.sleep(interval_s)

    async def poll_once(self) -> None:
        """Read every serving replica's engine counts once: export them, and tell the router."""
        running = waiting = 0
        usages: list[float] = []
        for replica in self.router.serving():
            follow = self.router.policy == "cacheAware"
            try:
                stats = await self.pool.engine_stats(
                    replica, CONTROL_TIMEOUT_S, self._blocks_seen.get(replica, []) if follow else None
                )
            except Exception as exc:
                log.debug("engine stats of replica %d: %s", replica, exc)
                continue
            try:
                counts = _engine_counts(stats)
                blocks = _block_report(stats.get("prefix_blocks"))
            except (KeyError, TypeError, ValueError) as exc:
                # One replica's malformed report (a worker of another version, a bug) costs that replica its
                # table and this poll, not the poll loop: its next report is asked for from the start.
                log.warning("engine stats of replica %d ignored, malformed: %r", replica, exc)
                self.router.forget_prefixes(replica)
                self._blocks_seen.pop(replica, None)
                continue
            self.router.observe_engine(replica, counts.streams, counts.block_size)
            self._count_prefix_cache(replica, counts.prefix)
            if blocks is not None:
                self._follow_blocks(replica, blocks)
            running += counts.running
            waiting += counts.waiting
            usages.append(counts.kv_usage)
            self.metrics.kv_cache_usage.labels(replica=str(replica)).set(usages[-1])
        for gauge, value in (
            (self.metrics.requests_running, running),
            (self.metrics.vllm_running, running),
            (self.metrics.requests_waiting, waiting),
            (self.metrics.vllm_waiting, waiting),
            (self.metrics.vllm_kv_usage, sum(usages) / len(usages) if usages else 0.0),
        ):
            gauge.set(value)

    def _count_prefix_cache(self, replica: int, now: tuple[int, int, int] | None) -> None:
        """Add what `replica`'s engine counted since the last poll (prefix-cache queries, hits, evictions) to the
        driver's counters (an engine that counts less than last time was restarted: all it counts is new)."""
        if now is None:
            return
        before = self._prefix_counts.get(replica, (0, 0, 0))
        if now[0] < before[0]:
            before = (0, 0, 0)
        self._prefix_counts[replica] = now
        self.metrics.prefix_cache_queries.inc(max(0, now[0] - before[0]))
        self.metrics.prefix_cache_hits.inc(max(0, now[1] - before[1]))
        if now[2] > before[2]:  # the engine dropped every finished request's blocks: so does the table
            self.router.forget_prefixes(replica)

    def _follow_blocks(self, replica: int, report: BlockReport) -> None:
        """Apply what `replica`'s engine reported of its prefix cache: the driver hashes stored and evicted
        since the last report, after forgetting all it held if the report is a reset."""
        if report.reset:
            self.router.forget_prefixes(replica)
        self.router.follow_blocks(replica, report.stored, report.removed)
        self._blocks_seen[replica] = [report.epoch, report.seq]
        for event, hashes in (("stored", report.stored), ("evicted", report.removed)):
            if hashes:
                self.metrics.routing_blocks_reported.labels(replica=str(replica), event=event).inc(
                    len(hashes)
                )


@dataclass(frozen=True)
class EngineCounts:
    """One replica's engine counts, read from its ``engine_stats`` reply."""

    streams: int  # requests it holds, of every driver
    running: int
    waiting: int
    kv_usage: float
    block_size: int | None
    prefix: tuple[int, int, int] | None  # prefix-cache queries, hits, evictions; None where not counted


@dataclass(frozen=True)
class BlockReport:
    """What an engine reported of its prefix cache since the position a driver asked from (``prefix_blocks``)."""

    epoch: int
    seq: int
    reset: bool
    stored: list[int]
    removed: list[int]


def _engine_counts(stats: dict[str, Any]) -> EngineCounts:
    """The counts of an ``engine_stats`` reply; raises KeyError, TypeError or ValueError on a malformed one."""
    if not isinstance(stats, dict):
        raise TypeError(f"engine stats are a {type(stats).__name__}, not an object")
    running, waiting = int(stats.get("requests_running", 0)), int(stats.get("requests_waiting", 0))
    prefix = None
    if "prefix_cache_queries" in stats:
        prefix = (
            int(stats["prefix_cache_queries"]),
            int(stats.get("prefix_cache_hits", 0)),
            int(stats.get("prefix_cache_evictions", 0)),
        )
    return EngineCounts(
        streams=int(stats.get("streams", running + waiting)),
        running=running,
        waiting=waiting,
        kv_usage=float(stats.get("kv_cache_usage", 0.0)),
        block_size=int(stats.get("block_size", 0)) or None,
        prefix=prefix,
    )


def _block_report(report: Any) -> BlockReport | None:
    """An engine's ``prefix_blocks`` report, checked whole before any of it is applied (None: the engine sent
    none); raises KeyError, TypeError or ValueError on a malformed one."""
    if report is None:
        return None
    if not isinstance(report, dict):
        raise TypeError(f"prefix_blocks is a {type(report).__name__}, not an object")
    stored, removed = report.get("stored") or [], report.get("removed") or []
    if not isinstance(stored, list) or not isinstance(removed, list):
        raise TypeError("prefix_blocks.stored and .removed must be lists")
    return BlockReport(
        epoch=int(report["epoch"]),
        seq=int(report["seq"]),
        reset=bool(report.get("reset")),
        stored=[int(h) for h in stored],
        removed=[int(h) for h in removed],
    )


async def _shielded(call: Any) -> None:
    """Run a clean-up call to its end even when the caller is being cancelled."""
    task = asyncio.ensure_future(call)
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.shield(task)
