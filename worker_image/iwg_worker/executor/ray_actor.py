"""`RayWorkerWrapper`: one rank of a group inside a Ray actor, driven by `RayExecutor` (`executor/ray.py`).

Methods travel as names and are resolved on the actor by the same allow-list as everywhere else
(`WorkerWrapperBase.resolve_method`); arguments and results are plain data (`ray_data.py`). Each actor also
runs a watch call in a concurrency group of its own that returns only when the executor stops it: when the
actor's process dies, Ray fails that call at once, which is how the executor learns of the death.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import ray

from iwg_worker.executor.ray_data import from_ray, to_ray
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_wrapper import WorkerWrapperBase

log = logging.getLogger(__name__)

WATCH_GROUP = "iwg-watch"


class RayWorkerWrapper(WorkerWrapperBase):
    """One rank inside a Ray actor: a `WorkerWrapperBase` plus the few methods the executor drives it with.

    The executor calls `serve_call` for every collective call; its reply is a plain map, ``{ok, result}``
    or ``{ok: False, error: {type, message, traceback}}``, as on the ZMQ wire.
    """

    def __init__(self, rpc_rank: int = 0) -> None:
        super().__init__(rpc_rank)
        self._watch_stopped = threading.Event()

    def node_info(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        group = ray.util.get_current_placement_group()
        return {
            "pid": os.getpid(),
            "placement_group": group.id.hex() if group is not None else "",
            "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "node_id": context.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A port that is free on this actor's node now: rank 0 serves the torch.distributed rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return int(probe.getsockname()[1])

    def init_worker_from_plain(self, all_kwargs: list[dict[str, Any]]) -> dict[str, Any]:
        """`init_worker` with each rank's ``config`` given as a plain map (the fields of `WorkerConfig`)."""

        def build() -> None:
            built = []
            for kwargs in all_kwargs:
                kwargs = dict(kwargs)
                if isinstance(kwargs.get("config"), dict):
                    kwargs["config"] = WorkerConfig(**kwargs["config"])
                built.append(kwargs)
            self.init_worker(built)

        return self._reply("init_worker", build)

    def set_environment(self, envs: list[Mapping[str, str]]) -> dict[str, Any]:
        return self._reply("update_environment_variables", lambda: self.update_environment_variables(envs))

    def serve_call(
        self, method: str, args: list[Any], kwargs: dict[str, Any], reply: bool, deadline: float | None
    ) -> dict[str, Any]:
        if deadline is not None and time.time() > deadline:
            message = f"call {method!r} reached rank {self.rpc_rank} after its deadline"
            return {"ok": False, "error": {"type": "DeadlineExceeded", "message": message, "traceback": ""}}

        def call() -> Any:
            result = self.execute_method(method, from_ray(args), from_ray(kwargs))
            return to_ray(result, f"result of {method!r}")[0] if reply else None

        return self._reply(method, call)

    def _reply(self, what: str, fn: Callable[[], Any]) -> dict[str, Any]:
        """Run ``fn``; its result or exception as a plain map (an exception object never crosses to Ray)."""
        try:
            return {"ok": True, "result": fn()}
        except Exception as exc:
            log.exception("%r failed on rank %d", what, self.rpc_rank)
            error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
            return {"ok": False, "error": error}

    @ray.method(concurrency_group=WATCH_GROUP)
    def watch(self) -> str:
        """Returns only when `stop_watch` is called: the executor learns of this process's death by its error."""
        self._watch_stopped.wait()
        return "stopped"

    @ray.method(concurrency_group=WATCH_GROUP)
    def stop_watch(self) -> None:
        self._watch_stopped.set()


_actor_class: Any = None


def ray_actor_class() -> Any:
    global _actor_class
    if _actor_class is None:
        # Two threads in the watch group: `watch` blocks one, `stop_watch` needs the other.
        _actor_class = ray.remote(concurrency_groups={WATCH_GROUP: 2})(RayWorkerWrapper)  # type: ignore[call-overload]
    return _actor_class
