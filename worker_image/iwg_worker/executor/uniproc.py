"""`UniProcExecutor`: one worker wrapper in this process; calls are method calls."""

from __future__ import annotations

import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from iwg_worker.executor.base import Executor, RPCError
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_proc import DEFAULT_WORKER_CLS
from iwg_worker.worker_wrapper import WorkerWrapperBase


class UniProcExecutor(Executor):
    """Timeouts are not enforced: the call runs on the caller's thread (or one helper thread for futures)."""

    def __init__(
        self,
        config: WorkerConfig,
        worker_cls: str | type = DEFAULT_WORKER_CLS,
        worker_extension_cls: str | type | None = None,
    ) -> None:
        if config.world_size != 1:
            raise ValueError(f"UniProcExecutor runs one rank; config.world_size is {config.world_size}")
        self.replicas = 1
        self.world_size = 1
        self.wrapper = WorkerWrapperBase(rpc_rank=0)
        self.wrapper.init_worker(
            [{"worker_cls": worker_cls, "worker_extension_cls": worker_extension_cls, "config": config}]
        )
        worker = self.wrapper.require_worker()
        worker.init_device()
        worker.load_model()
        worker.set_stream_sink(lambda items: self.streams.deliver(0, items))
        self._pool: ThreadPoolExecutor | None = None

    def _call(self, method: str, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any] | None) -> Any:
        try:
            return self.wrapper.execute_method(method, args, kwargs or {})
        except Exception as exc:
            raise RPCError(method, 0, 0, type(exc).__name__, str(exc), traceback.format_exc()) from exc

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Any:
        self._address_call(method, replica, unique_reply_rank)
        result = self._call(method, args, kwargs)
        return result if unique_reply_rank is not None else [result]

    def collective_rpc_future(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iwg-uniproc")
        return self._pool.submit(
            self.collective_rpc, method, args, kwargs, timeout, unique_reply_rank, replica
        )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.wrapper.worker is not None:
            self.wrapper.worker.shutdown()
            self.wrapper.worker = None
