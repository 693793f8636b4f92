"""A generation group on vLLM's engine (spec.model.engine vllm: SmolLM2, eager, a 16-block KV cache) through the
operator on real kubelets, the worker on the light image with its model on a volume, reached through the
driver's Service (kube-proxy; no retries), in sequence on one group: it serves and reports its engine (status.engine, the ENGINE column),
streams a right chat answer through the official `openai` client, a SIGKILLed worker is replaced by the
restart rules and the replacement answers again, and streaming chat load scales it 1 -> 2 on requestsWaiting
(the engine's queued requests) and back after the window, losing no request. A cluster of its own, in the e2e
lane (tests/lanes.py).

Each worker gets 1500m of CPU (the example's 2 CPUs, twice, and a driver do not fit two 2-CPU nodes when the
group scales to two replicas); vLLM's CPU worker sizes its threads by the cgroup's quota."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import pytest
from openai import OpenAI

from tests.cluster.waiting import eventually
from tests.e2e.autoscale import (
    CHAT_TIMEOUT_S,
    CONTEXT,
    KV_BLOCKS,
    ReplicaTimeline,
    autoscaling,
    step_up_and_back,
)
from tests.e2e.harness import (
    FAST_HEALTH,
    ChatLoad,
    await_replacement,
    events,
    group_manifest,
    joined,
    live_ready_workers,
    openai_client,
)
from tests.models import smollm2_manifest
from tests.realnodes.fixture import RealCluster, cluster, real_cluster
from tests.realnodes.nodes import WORKER_IMAGE

__all__ = ["cluster", "real_cluster"]

# Three vLLM starts (the first replica, its replacement, the second replica) on a shared 2-core machine.
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

# The self-heal test's rules (failureThreshold 2, no backoff), but probes every 4 s that may take the whole
# period: a worker whose engine is busy with ten streams on two cores (or a stalled process) can answer its
# health check late, and that must not count as a failure. A SIGKILLed worker refuses the probe at once (and
# its container ends), so detection still takes two periods at most (8 s; step 3 waits up to 300 s).
PERIOD = 4
HEALTH = {**FAST_HEALTH, "periodSeconds": PERIOD, "timeoutSeconds": PERIOD}
START_TIMEOUT_S = 300.0


@dataclass
class UnsharedChatLoad(ChatLoad):
    """ChatLoad whose prompts start with their client and number. vLLM's prefix cache shares the full KV
    blocks that running prompts have in common: ChatLoad's 200-token prompts share their first 180 tokens (the
    system prompt and the context), so two of each prompt's four blocks would be shared and a 16-block replica
    would run seven streams instead of four, and ten streams on two replicas would leave none waiting (the
    scale-down window would start under load). Prompts that differ within their first block share none."""

    def request(self, api: OpenAI, index: int, n: int) -> None:
        ChatLoad.request(
            replace(self, context=f"Client {index}, question {n}. {self.context}"), api, index, n
        )


def stream_france(port: int) -> str:
    """The France question as a stream through the Service's port; the text it carried, once it ended with a
    finish reason."""
    stream = openai_client("127.0.0.1", port).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    text, finish = joined(stream)
    assert finish in ("stop", "length"), (finish, text)
    return text


def test_a_vllm_group_serves_heals_and_scales_on_requests_waiting(cluster: RealCluster) -> None:
    groups, core, workspace = cluster.groups, cluster.core, cluster.namespace
    name = "vllm"
    manifest = group_manifest(
        name,
        smollm2_manifest(KV_BLOCKS, engine="vllm"),
        replicas=1,
        health=HEALTH,
        autoscaling=autoscaling("requestsWaiting", 1),
    )
    spec = manifest["spec"]
    spec["worker"] = {**spec["worker"], "image": WORKER_IMAGE, "imagePullPolicy": "Never", "cpu": "1500m"}
    spec["driver"] = {**spec["driver"], "cpu": "500m"}
    volume = cluster.model_volume("smollm2", Path(spec["model"]["path"]))
    spec["model"] = {**spec["model"], "volume": volume, "path": volume["mountPath"]}
    cluster.apply(manifest)
    started = time.monotonic()

    # 1. Serving, on vLLM's engine as the worker reports it.
    port = cluster.wait_serving(name, replicas=1, timeout=START_TIMEOUT_S)
    print(f"serving {time.monotonic() - started:.1f}s after apply")
    eventually(
        lambda: (groups.get(name).get("status") or {}).get("engine") == "vllm", 30, "status.engine vllm"
    )
    table = cluster.control_plane.kubectl("get", "iwg", "-n", workspace).stdout
    assert "ENGINE" in table and "vllm" in table, table

    # 2. A streamed chat answer.
    assert "Paris" in stream_france(port)

    # 3. SIGKILL the worker: the restart rules replace its pod, and the new vLLM engine answers.
    time.sleep(PERIOD * 2)  # the prober has seen the worker healthy: it supervises it
    victim = live_ready_workers(core, workspace, name)[0]
    # vLLM's engine core and model process, which the worker spawned: they must not outlive it.
    engine_processes = psutil.Process(cluster.pid_of(victim)).children(recursive=True)
    assert engine_processes, "the worker runs vLLM's engine in processes of its own"
    killed = time.monotonic()
    cluster.signal_container(victim, signal.SIGKILL)
    try:
        recovery = await_replacement(core, groups, name, [victim], killed, 1, timeout=START_TIMEOUT_S)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
    print(f"SIGKILL: detected after {recovery.detected_s:.2f}s, serving after {recovery.ready_s:.2f}s")
    answer = eventually(lambda: stream_france(port), 120, "an answer from the replacement", 1.0, (Exception,))
    assert "Paris" in answer
    left = [p.pid for p in engine_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"vLLM processes of the killed worker still running: {left}"
    unhealthy = events(core, workspace, name, "WorkerUnhealthy")
    assert any(victim.metadata.name in e.message for e in unhealthy), [e.message for e in unhealthy]
    status = groups.get(name)["status"]
    assert status.get("restartCount", 0) >= 1 and status.get("engine") == "vllm", status

    # 4. Streaming chat load: 200-token prompts take 4 of the 16 blocks, so one replica runs 4 streams and
    # queues the rest (requestsWaiting); ten streams scale the group to two (eight run, one waits on each: the
    # target, so it holds), and back to one once they stop.
    model = manifest["spec"]["model"]["servedName"]
    timeline = ReplicaTimeline(groups, name).start()
    light = ChatLoad("127.0.0.1", model, clients=1, max_tokens=8, timeout=CHAT_TIMEOUT_S, port=port).start()
    heavy = UnsharedChatLoad(
        "127.0.0.1", model, clients=10, max_tokens=4, context=CONTEXT, timeout=CHAT_TIMEOUT_S, port=port
    )
    # The second replica's vLLM start took 150 s+ under the suite's load once (import to engine core: 140 s).
    messages = step_up_and_back(
        groups,
        core,
        name,
        timeline,
        heavy,
        light,
        lambda n: cluster.wait_serving(name, n, timeout=START_TIMEOUT_S),
    )
    assert heavy.ok >= 10 and light.ok >= 3
    assert any(m.startswith("replicas 1 -> 2: requestsWaiting") for m in messages), messages
    assert all("requestsWaiting" in m for m in messages), messages
    print(f"whole test {time.monotonic() - started:.1f}s after apply")
