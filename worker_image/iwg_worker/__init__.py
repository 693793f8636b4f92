"""iwg worker runtime: the process, wrapper and worker layers, executors and the group driver."""

from iwg_worker.spawned import watch_if_spawned

watch_if_spawned()  # vLLM's engine core and model process, spawned by a worker, end with it (see spawned)
