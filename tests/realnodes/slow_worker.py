"""A TorchWorker that takes longer for every batch (0.4 s, or E2E_SLOW_BATCH_S from its environment), so that
a replica always has batches in flight under load (`spec.worker.workerCls: tests.realnodes.slow_worker.SlowWorker`;
the nodes' containers have the repository importable)."""

from __future__ import annotations

import os
import time
from typing import Any

from iwg_worker.torch_worker import TorchWorker

SLOW_BATCH_S = float(os.environ.get("E2E_SLOW_BATCH_S", "0.4"))


class SlowWorker(TorchWorker):
    def execute_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        time.sleep(SLOW_BATCH_S)
        return super().execute_model(batch)
