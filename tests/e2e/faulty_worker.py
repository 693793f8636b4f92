"""A TorchWorker whose device can be made to fail from outside, for the device-fault end-to-end test.

`spec.worker.workerCls: tests.e2e.faulty_worker.FaultyDeviceWorker`; the worker reports its device
unavailable while the file FAULT_DIR/<its pod IP> exists (the node agent puts the repository on PYTHONPATH).
"""

from __future__ import annotations

import os
from pathlib import Path

from iwg_operator.api import wiring
from iwg_worker.torch_worker import TorchWorker

FAULT_DIR = Path("/run/iwg-e2e-device-faults")


class FaultyDeviceWorker(TorchWorker):
    def _device_available(self) -> bool:
        if (FAULT_DIR / os.environ.get(wiring.POD_IP, "-")).exists():
            self.device_note = "injected device fault (Xid 79: GPU has fallen off the bus)"
            return False
        return super()._device_available()
