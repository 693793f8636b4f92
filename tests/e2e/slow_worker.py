"""A TorchWorker that takes SLOW_BATCH_S longer for every batch, so that a replica always has batches in
flight under load (`spec.worker.workerCls: tests.e2e.slow_worker.SlowWorker`; the node agent puts the
repository on PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

from iwg_worker.torch_worker import TorchWorker

SLOW_BATCH_S = 0.4


class SlowWorker(TorchWorker):
    def execute_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        time.sleep(SLOW_BATCH_S)
        return super().execute_model(batch)
