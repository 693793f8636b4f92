"""A TorchWorker whose device can be made to fail from outside, for the device-fault test on real nodes.

`spec.worker.workerCls: tests.realnodes.faulty_worker.FaultyDeviceWorker` (the nodes' containers have the
repository importable); the worker reports its device unavailable while the file FAULT_FILE exists in its
pod (the pod's /tmp, an emptyDir: `kubectl exec <pod> -- touch` it).
"""

from __future__ import annotations

from pathlib import Path

from iwg_worker.torch_worker import TorchWorker

FAULT_FILE = Path("/tmp/iwg-injected-device-fault")


class FaultyDeviceWorker(TorchWorker):
    def _device_available(self) -> bool:
        if FAULT_FILE.exists():
            self.device_note = "injected device fault (Xid 79: GPU has fallen off the bus)"
            return False
        return super()._device_available()
