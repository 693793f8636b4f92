"""`RayExecutor`: a group's ranks as Ray actors, one `RayWorkerWrapper` per rank, a placement group per replica.

Three files, one role each: this one places the actors and runs the calls; `ray_actor.py` is the actor
(`RayWorkerWrapper`); `ray_data.py` lets only plain data cross (Ray's own pickle-based serializer is Ray's
transport inside the user's trusted Ray cluster, not iwg's wire; iwg adds no pickle) and sends torch tensors
as their bytes with the project's one tensor codec (`protocol.tensor_bytes`). Methods travel as names,
resolved on the actor by the same allow-list as everywhere else; no callable travels.

Ray is imported by this module and `ray_actor.py` alone: `iwg_worker`, its other executors and `iwg serve`
without ``--executor ray`` never import it, and `iwg_operator` never imports them. Install the ``ray``
extra.

Placement: each replica gets a placement group of ``world_size`` bundles (one GPU each where the cluster has
GPUs, else one CPU), ``PACK``ed by default so a replica's ranks share a node where they fit; rank k's actor
takes bundle k. With ``world_size > 1`` the ranks join torch.distributed at rank 0's node address.

Failure: each actor also runs a watch call in a concurrency group of its own that returns only when the
executor stops it. When an actor's process dies, Ray fails that call at once: the rank is marked lost, every
pending call on its replica fails with `ReplicaLostError`, later calls to that replica raise
`ReplicaUnavailableError`, and subscribers get ``left`` and ``lost`` events; other replicas keep serving.
Actors are not restarted (a torch.distributed group cannot take in a new member): build a new executor.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray
from iwg_operator.api import wiring
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from iwg_worker.executor.base import (
    Executor,
    MembershipCallback,
    MembershipEvent,
    PendingCall,
    ReplicaLostError,
    ReplicaUnavailableError,
    RPCError,
    RPCTimeoutError,
)
from iwg_worker.executor.ray_actor import ray_actor_class
from iwg_worker.executor.ray_data import from_ray, to_ray
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_proc import DEFAULT_WORKER_CLS

log = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
DEFAULT_STARTUP_TIMEOUT_S = 300.0
_SHUTDOWN_CALL_TIMEOUT_S = 5.0
_SHARED_PAYLOAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RayRank:
    """Where one rank runs."""

    replica: int
    rank: int
    actor: Any  # ray.actor.ActorHandle
    pid: int
    ip: str
    node_id: str
    gpu_ids: tuple[str, ...]
    placement_group: str

    def describe(self) -> str:
        return f"replica {self.replica} rank {self.rank} (Ray actor pid {self.pid} on {self.ip})"


def _default_bundle(device: str) -> dict[str, float]:
    if device == "cpu":
        return {"CPU": 1.0}
    gpus = ray.cluster_resources().get("GPU", 0.0)  # type: ignore[no-untyped-call]
    if device == "cuda" or gpus >= 1:
        return {"GPU": 1.0}
    return {"CPU": 1.0}


def _died_reason(rank: RayRank, exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = next(
        (line for line in lines if line.startswith("The actor is dead because")), lines[0] if lines else ""
    )
    detail = detail.split(" Some common causes")[0]
    if len(detail) > 240:
        detail = detail[:240] + "..."
    return f"the Ray actor of {rank.describe()} died: {type(exc).__name__}: {detail}"


class RayExecutor(Executor):
    """``replicas`` replicas of ``world_size`` ranks (default: ``config.world_size``), each rank a
    `RayWorkerWrapper` actor; the arguments mirror `MultiprocExecutor`'s.

    Joins the Ray cluster at ``ray_address`` (or ``RAY_ADDRESS``; a local Ray is started when neither is set)
    unless this process is already connected; only a Ray it started itself is shut down with the executor.
    ``bundle`` overrides each rank's resources, e.g. ``{"GPU": 1, "CPU": 4}``; ``extra_env`` is set in every
    actor before its worker is built.
    """

    def __init__(
        self,
        config: WorkerConfig,
        replicas: int = 1,
        world_size: int | None = None,
        worker_cls: str | type = DEFAULT_WORKER_CLS,
        worker_extension_cls: str | type | None = None,
        *,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        extra_env: Mapping[str, str] | None = None,
        ray_address: str | None = None,
        bundle: Mapping[str, float] | None = None,
        placement_strategy: str = "PACK",
        ray_init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        world_size = config.world_size if world_size is None else world_size
        if replicas < 1 or world_size < 1:
            raise ValueError(f"replicas and world_size must be >= 1, got {replicas} and {world_size}")
        if config.task == "generate":
            raise ValueError(
                "task 'generate' streams tokens from the worker to the driver, which RayExecutor does not "
                "carry: serve generation with the multiproc executor or on Kubernetes"
            )
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {placement_strategy!r}"
            )
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        env = dict(extra_env or {})
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"extra_env must map str to str, got {key!r}: {value!r}")
        self.replicas = replicas
        self.world_size = world_size
        self.config = dataclasses.replace(config, world_size=world_size, rank=0)
        self._extra_env = env
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, PendingCall] = {}
        self._lost: dict[tuple[int, int], str] = {}
        self._subscribers: list[MembershipCallback] = []
        self._closed = False
        self._timer_cv = threading.Condition(self._lock)
        self._deadlines: list[tuple[float, int]] = []
        self._timer_thread: threading.Thread | None = None
        self._watches: dict[tuple[int, int], Any] = {}
        self.ranks: dict[tuple[int, int], RayRank] = {}
        self._placement_groups: list[PlacementGroup] = []
        self._actors: list[Any] = []

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address, **dict(ray_init_kwargs or {}))
        self.bundle = dict(bundle) if bundle is not None else _default_bundle(config.device)
        try:
            self._start(
                self.config,
                _class_name(worker_cls) or DEFAULT_WORKER_CLS,
                _class_name(worker_extension_cls),
                placement_strategy,
                startup_timeout_s,
            )
        except BaseException:
            self.shutdown()
            raise

    # -- startup ---------------------------------------------------------------------------------------

    def _start(
        self, config: WorkerConfig, worker_cls: str, extension_cls: str | None, strategy: str, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        for _replica in range(self.replicas):
            self._placement_groups.append(
                placement_group([dict(self.bundle)] * self.world_size, strategy=strategy)
            )
        ready = [pg.ready() for pg in self._placement_groups]
        _done, not_done = ray.wait(ready, num_returns=len(ready), timeout=timeout)
        if not_done:
            late = [i for i, ref in enumerate(ready) if ref in not_done]
            available = ray.available_resources()  # type: ignore[no-untyped-call]
            raise RuntimeError(
                f"Ray could not place replicas {late} ({self.world_size} x {self.bundle}, {strategy}) within "
                f"{timeout:g} s; the cluster has {available} available"
            )
        options = {
            "num_cpus": self.bundle.get("CPU", 0.0),
            "num_gpus": self.bundle.get("GPU", 0.0),
            "resources": {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        actor_class = ray_actor_class()
        handles: dict[tuple[int, int], Any] = {}
        for replica, pg in enumerate(self._placement_groups):
            for rank in range(self.world_size):
                strategy_for_rank = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                )
                actor = actor_class.options(scheduling_strategy=strategy_for_rank, **options).remote(rank)
                handles[(replica, rank)] = actor
                self._actors.append(actor)

        infos = self._startup_step("start", {k: a.node_info.remote() for k, a in handles.items()}, deadline)
        for (replica, rank), info in infos.items():
            self.ranks[(replica, rank)] = RayRank(
                replica,
                rank,
                handles[(replica, rank)],
                int(info["pid"]),
                str(info["ip"]),
                str(info["node_id"]),
                tuple(info["gpu_ids"]),
                str(info["placement_group"]),
            )
        ports: dict[tuple[int, int], Any] = {}
        if self.world_size > 1:
            ports = self._startup_step(
                "rendezvous",
                {(r, 0): self.ranks[(r, 0)].actor.free_port.remote() for r in range(self.replicas)},
                deadline,
            )
        env_refs = {}
        for replica in range(self.replicas):
            envs = [dict(self._extra_env) for _rank in range(self.world_size)]
            if self.world_size > 1:
                for rank, env in enumerate(envs):
                    env[wiring.MASTER_ADDR] = self.ranks[(replica, 0)].ip
                    env[wiring.MASTER_PORT] = str(ports[(replica, 0)])
                    env[wiring.TORCH_RANK] = str(rank)
                    env[wiring.TORCH_WORLD_SIZE] = str(self.world_size)
            for rank in range(self.world_size):
                actor = self.ranks[(replica, rank)].actor
                env_refs[(replica, rank)] = actor.set_environment.remote(envs)
        self._startup_step("update_environment_variables", env_refs, deadline)

        init_refs = {}
        for replica in range(self.replicas):
            all_kwargs = [
                {
                    "worker_cls": worker_cls,
                    "worker_extension_cls": extension_cls,
                    "config": dataclasses.asdict(dataclasses.replace(config, replica=replica, rank=rank)),
                }
                for rank in range(self.world_size)
            ]
            for rank in range(self.world_size):
                actor = self.ranks[(replica, rank)].actor
                init_refs[(replica, rank)] = actor.init_worker_from_plain.remote(all_kwargs)
        self._startup_step("init_worker", init_refs, deadline)
        # All ranks of a replica must be in init_device together: that is where torch.distributed meets.
        for phase in ("init_device", "load_model"):
            refs = {
                key: r.actor.serve_call.remote(phase, [], {}, True, None) for key, r in self.ranks.items()
            }
            self._startup_step(phase, refs, deadline)
        for key, rank_info in self.ranks.items():
            watch = rank_info.actor.watch.remote()
            self._watches[key] = watch
            watch.future().add_done_callback(lambda f, key=key: self._on_watch_end(key, f))
        log.info(
            "RayExecutor: %d replica(s) x %d rank(s) on %s, bundle %s",
            self.replicas,
            self.world_size,
            sorted({r.ip for r in self.ranks.values()}),
            self.bundle,
        )

    def _startup_step(
        self, step: str, refs: dict[tuple[int, int], Any], deadline: float
    ) -> dict[tuple[int, int], Any]:
        """Wait for one startup step on every rank: the results, or an error naming the step and the ranks
        (`RPCError` with the worker's traceback where the step raised)."""
        keys = list(refs)
        left = max(deadline - time.monotonic(), 0.0)
        _done, not_done = ray.wait([refs[k] for k in keys], num_returns=len(keys), timeout=left)
        if not_done:
            late = sorted(k for k in keys if refs[k] in not_done)
            raise TimeoutError(
                f"RayExecutor startup step {step!r} timed out; no answer from (replica, rank) {late}"
            )
        results = {}
        for key in keys:
            try:
                reply = ray.get(refs[key])
            except ray.exceptions.RayError as exc:
                cause = (
                    _died_reason(self.ranks[key], exc)
                    if key in self.ranks
                    else f"{type(exc).__name__}: {exc}"
                )
                raise RuntimeError(
                    f"RayExecutor startup step {step!r} failed on replica {key[0]} rank {key[1]}: {cause}"
                ) from exc
            if isinstance(reply, dict) and reply.get("ok") is False:
                e = reply["error"]
                raise RPCError(step, key[0], key[1], e["type"], e["message"], e["traceback"])
            results[key] = reply["result"] if isinstance(reply, dict) and "ok" in reply else reply
        return results

    # -- calls -----------------------------------------------------------------------------------------

    def collective_rpc_future(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Future[Any]:
        targets = self._address_call(method, replica, unique_reply_rank)
        call_args, args_bytes = to_ray(list(args), "args")
        call_kwargs, kwargs_bytes = to_ray(dict(kwargs or {}), "kwargs")
        payload_bytes = args_bytes + kwargs_bytes
        pending = PendingCall.start(
            next(self._ids), method, targets, unique_reply_rank, self.world_size, timeout
        )
        future = pending.future
        with self._lock:
            if self._closed:
                raise RuntimeError("executor is shut down")
            for r in targets:
                lost = [k for k in range(self.world_size) if (r, k) in self._lost]
                if lost:
                    raise ReplicaUnavailableError(method, r, lost)
            self._pending[pending.id] = pending
            if timeout is not None:
                self._arm_timer(time.monotonic() + timeout, pending.id)
        wall_deadline = None if timeout is None else time.time() + timeout
        fan_out = len(targets) * self.world_size
        # Large payloads for many ranks: one copy in the object store instead of one serialisation per rank
        # (a put costs a round trip to the object store, more than it saves on small payloads).
        if fan_out > 1 and payload_bytes >= _SHARED_PAYLOAD_BYTES:
            shared_args: Any = ray.put(call_args)
            shared_kwargs: Any = ray.put(call_kwargs) if call_kwargs else call_kwargs
        else:
            shared_args, shared_kwargs = call_args, call_kwargs
        for r in targets:
            for k in range(self.world_size):
                reply = unique_reply_rank is None or k == unique_reply_rank
                ref = self.ranks[(r, k)].actor.serve_call.remote(
                    method, shared_args, shared_kwargs, reply, wall_deadline
                )
                ref.future().add_done_callback(lambda f, key=(r, k): self._on_reply(pending, key, f))
        return future

    def _on_reply(self, pending: PendingCall, key: tuple[int, int], done: Future[Any]) -> None:
        replica, rank = key
        try:
            reply = done.result()
        except ray.exceptions.RayActorError as exc:
            self._rank_lost(key, _died_reason(self.ranks[key], exc))
            return
        except Exception as exc:
            self._finish(pending, RPCError(pending.method, replica, rank, type(exc).__name__, str(exc), ""))
            return
        if not reply["ok"]:
            e = reply["error"]
            self._finish(
                pending, RPCError(pending.method, replica, rank, e["type"], e["message"], e["traceback"])
            )
            return
        if key not in pending.expected:
            return
        result = from_ray(reply["result"])
        with self._lock:
            if pending.future.done():
                return
            pending.results[key] = result
            pending.expected.discard(key)
            complete = not pending.expected
            if complete:
                self._pending.pop(pending.id, None)
        if complete:
            try:
                result = pending.assemble()
            except Exception as exc:
                pending.future.set_exception(exc)
                return
            _settle(pending.future, result=result)

    def _finish(self, pending: PendingCall, error: BaseException) -> None:
        with self._lock:
            self._pending.pop(pending.id, None)
        _settle(pending.future, error=error)

    # -- failure ---------------------------------------------------------------------------------------

    def _on_watch_end(self, key: tuple[int, int], done: Future[Any]) -> None:
        exc = done.exception()
        if exc is not None:
            self._rank_lost(key, _died_reason(self.ranks[key], exc))

    def _rank_lost(self, key: tuple[int, int], reason: str) -> None:
        replica, rank = key
        with self._lock:
            if self._closed or key in self._lost:
                return
            replica_was_serving = not any((replica, k) in self._lost for k in range(self.world_size))
            self._lost[key] = reason
            victims = [p for p in self._pending.values() if replica in p.targets]
            for p in victims:
                self._pending.pop(p.id, None)
            serving = self._serving_locked()
            subscribers = list(self._subscribers)
        log.error("%s", reason)
        for p in victims:
            _settle(p.future, error=ReplicaLostError(p.method, replica, [rank], reason))
        events = [MembershipEvent("left", replica, rank, reason, serving)]
        if replica_was_serving:
            events.append(MembershipEvent("lost", replica, None, reason, serving))
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:
                    log.exception("membership callback failed on %s", event)

    def _serving_locked(self) -> frozenset[int]:
        lost_replicas = {r for r, _k in self._lost}
        return frozenset(r for r in range(self.replicas) if r not in lost_replicas)

    def serving_replicas(self) -> frozenset[int]:
        with self._lock:
            return self._serving_locked()

    def lost_ranks(self) -> dict[tuple[int, int], str]:
        """(replica, rank) -> why it was lost."""
        with self._lock:
            return dict(self._lost)

    def subscribe(self, callback: MembershipCallback) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    # -- timeouts --------------------------------------------------------------------------------------

    def _arm_timer(self, deadline: float, call_id: int) -> None:
        # Called with self._lock held.
        heapq.heappush(self._deadlines, (deadline, call_id))
        if self._timer_thread is None:
            self._timer_thread = threading.Thread(
                target=self._timer_loop, name="iwg-ray-timeouts", daemon=True
            )
            self._timer_thread.start()
        elif self._deadlines[0][1] == call_id:
            self._timer_cv.notify()

    def _timer_loop(self) -> None:
        while True:
            expired: list[PendingCall] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _deadline, call_id = heapq.heappop(self._deadlines)
                    pending = self._pending.pop(call_id, None)
                    if pending is not None:
                        expired.append(pending)
                if not expired:
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._timer_cv.wait(wait)
                    continue
            for p in expired:
                _settle(p.future, error=RPCTimeoutError(p.method, p.expected, p.timeout or 0.0))

    # -- shutdown --------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
            self._timer_cv.notify_all()
        for p in pending:
            _settle(
                p.future, error=RuntimeError(f"{p.method!r}: executor shut down while the call was pending")
            )
        lost_replicas = {replica for replica, _rank in self._lost}
        live = [r for r in self.ranks.values() if r.replica not in lost_replicas]
        if live:
            # Let the workers of intact replicas release their devices and process groups (a lost replica's
            # ranks may be stuck in a collective); a rank that does not answer in time is killed anyway.
            refs = [r.actor.serve_call.remote("shutdown", [], {}, False, None) for r in live]
            refs += [r.actor.stop_watch.remote() for r in live]
            ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_CALL_TIMEOUT_S)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                log.debug("ray.kill failed", exc_info=True)
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                log.debug("remove_placement_group failed", exc_info=True)
        self._actors.clear()
        self._placement_groups.clear()
        if self._timer_thread is not None:
            self._timer_thread.join(timeout=5)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless a racing path (reply, loss, timeout, shutdown) already did."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:  # InvalidStateError: already settled
        pass


def _class_name(cls: str | type | None) -> str | None:
    if cls is None or isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}"
