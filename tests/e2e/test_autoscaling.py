"""The autoscaler on real load: a load step scales the group up to max, and when load falls it scales down
after the stabilization window, draining the leaving replica first: no flapping, no failed request."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.harness import Load, eventually, group_manifest, wait_serving
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL = "all-MiniLM-L6-v2"
DOWN_WINDOW_S = 10


class ReplicaTimeline:
    """spec.replicas as the autoscaler writes it, sampled every 0.2 s."""

    def __init__(self, groups: Groups, name: str) -> None:
        self.values: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(groups, name), daemon=True)

    def _run(self, groups: Groups, name: str) -> None:
        while not self._stop.is_set():
            replicas = int(groups.get(name)["spec"]["replicas"])
            if not self.values or self.values[-1][1] != replicas:
                self.values.append((time.monotonic(), replicas))
            time.sleep(0.2)

    def start(self) -> ReplicaTimeline:
        self._thread.start()
        return self

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(timeout=10)
        return [v for _, v in self.values]

    def current(self) -> int:
        return self.values[-1][1] if self.values else -1


def test_load_step_scales_up_to_max_then_down_after_the_window_without_losing_requests(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "elastic"
    manifest = group_manifest(
        name,
        replicas=1,
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 2,
            "metric": "inflight",
            "target": 1.5,
            "tolerance": 0.1,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": DOWN_WINDOW_S,
        },
    )
    control_plane.kubectl("apply", "-n", workspace, "-f", "-", input=yaml.safe_dump(manifest))
    address = wait_serving(groups, core, node_agent, name, replicas=1)
    timeline = ReplicaTimeline(groups, name).start()

    heavy = Load(address, MODEL, clients=4, inputs=8).start()
    eventually(lambda: timeline.current() == 2, 60, "scale-up to maxReplicas")
    wait_serving(groups, core, node_agent, name, replicas=2)
    time.sleep(3)
    light = Load(address, MODEL, clients=1, inputs=1).start()
    # The load starts falling when the heavy clients stop sending, not when their last answers are in:
    # stop() waits for those, seconds on a busy machine, and the window may already run meanwhile.
    scaled_down_after = time.monotonic()
    heavy.stop()
    eventually(lambda: timeline.current() == 1, DOWN_WINDOW_S + 60, "scale-down after the window")
    waited = time.monotonic() - scaled_down_after
    eventually(lambda: len([p for p in groups.live_pods(name)]) == 1, 60, "the second replica's pod to go")
    time.sleep(3)
    light.stop()
    history = timeline.stop()

    print(f"replicas {history}; scale-down {waited:.1f}s after the load fell (window {DOWN_WINDOW_S}s)")
    assert history == [1, 2, 1]  # up once, down once: no flapping
    assert waited >= DOWN_WINDOW_S - 1
    assert heavy.failures == [] and light.failures == [], (heavy.failures[:3], light.failures[:3])
    assert heavy.ok > 10 and light.ok > 5
    status = groups.get(name)["status"]
    assert status["scaleCount"] == 2
    scaling = next(c for c in status["conditions"] if c["type"] == "ScalingActive")
    assert scaling["status"] == "True", scaling
    reasons = [
        e.reason
        for e in core.list_namespaced_event(workspace, field_selector=f"involvedObject.name={name}").items
    ]
    assert reasons.count("Autoscaled") == 2
