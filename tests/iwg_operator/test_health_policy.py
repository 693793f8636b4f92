"""Pure decisions of the health prober."""

from __future__ import annotations

from typing import Any

import pytest
from iwg_operator.api.v1alpha1 import HealthSpec
from iwg_operator.health.policy import (
    MAX_AVOIDED_NODES,
    PodHealth,
    ProbeOutcome,
    avoid_after_fault,
    avoid_nodes,
    backoff_delay,
    current_avoided,
    group_engine,
    judge_health_response,
    observe,
    pods_to_replace,
    restart_decision,
    shown_engine,
)
from iwg_operator.planning import ObservedPod


def pod(
    replica: int, rank: int, restarts: int = 0, ready: bool = True, phase: str = "Running"
) -> ObservedPod:
    return ObservedPod(
        name=f"g-r{replica}-w{rank}",
        group="g",
        replica=replica,
        rank=rank,
        revision="a",
        phase=phase,
        ready=ready,
        uid=f"u{replica}{rank}",
        ip="10.0.0.1",
        restarts=restarts,
        node="n1",
    )


def test_health_answers_are_judged() -> None:
    assert judge_health_response(200, {"alive": True, "worker": {"device_available": True}}, None).healthy
    hung = judge_health_response(None, None, "no health answer within 3s")
    assert not hung.healthy and "3s" in hung.reason
    silent = judge_health_response(503, {"alive": False, "busy_loop_age_s": 12.5}, None)
    assert not silent.healthy and "12.5" in silent.reason and not silent.device_fault
    fault = judge_health_response(
        503, {"alive": False, "worker": {"device_available": False, "device_note": "Xid 79"}}, None
    )
    assert fault.device_fault and "Xid 79" in fault.reason


def test_a_healthy_answer_carries_the_engine_its_worker_resolved() -> None:
    def engine_of(report: dict[str, Any]) -> str | None:
        return judge_health_response(200, {"alive": True, "worker": report}, None).engine

    assert engine_of({"device_available": True, "engine": "vllm"}) == "vllm"
    assert engine_of({"device_available": True, "engine": "transformers"}) == "transformers"
    # embed (null), a worker that does not say (an older image), or a value no engine has: none.
    for report in ({"engine": None}, {}, {"engine": "auto"}, {"engine": ["vllm"]}):
        assert engine_of({"device_available": True, **report}) is None
    assert judge_health_response(200, {"alive": True}, None).engine is None
    assert judge_health_response(503, {"worker": {"engine": "vllm"}}, None).engine is None


def test_a_pod_remembers_the_engine_of_its_last_healthy_answer() -> None:
    memory, p = PodHealth(), pod(0, 0)
    observe(memory, p, ProbeOutcome(True, engine="vllm"), 3, now=1.0)
    assert memory.engine == "vllm"
    observe(memory, p, ProbeOutcome(False, "timeout"), 3, now=2.0)
    assert memory.engine == "vllm", "a missed check says nothing about the engine"
    observe(memory, p, ProbeOutcome(True), 3, now=3.0)
    assert memory.engine is None


@pytest.mark.parametrize(
    ("engines", "shown"),
    [
        (["vllm", "vllm"], "vllm"),
        (["transformers"], "transformers"),
        (["vllm", None, "vllm"], "vllm"),  # a pod not yet answered counts for nothing
        (["vllm", "transformers", "vllm"], "transformers,vllm"),  # mid-rollout: every engine, sorted
        ([None, None], None),  # embed, or no answer yet
        ([], None),  # no workers
    ],
)
def test_the_group_engine_is_what_its_workers_report(engines: list[str | None], shown: str | None) -> None:
    assert group_engine(engines) == shown


def test_the_shown_engine_survives_a_replacement_until_a_worker_answers() -> None:
    answered = PodHealth(was_healthy=True, engine="vllm")
    assert shown_engine(None, [answered]) == "vllm"
    # The killed pod is gone and its successor not yet created, then created and starting: still vLLM.
    assert shown_engine("vllm", []) == "vllm"
    assert shown_engine("vllm", [PodHealth()]) == "vllm"
    # Once a worker answers, what it reports wins (a spec change to the other engine shows when it serves).
    assert shown_engine("vllm", [PodHealth(), PodHealth(was_healthy=True, engine="transformers")]) == (
        "transformers"
    )
    # A worker that answered without an engine (task embed, an older image) clears it.
    assert shown_engine("vllm", [PodHealth(was_healthy=True)]) is None


def test_failures_count_only_after_a_first_healthy_answer() -> None:
    memory, p = PodHealth(), pod(0, 0)
    bad = ProbeOutcome(False, "connection refused")
    for t in range(5):
        assert not observe(memory, p, bad, 3, now=float(t))
    assert memory.failures == 0
    assert not observe(memory, p, ProbeOutcome(True), 3, now=6.0)
    assert memory.was_healthy


def test_consecutive_failures_reach_the_threshold_and_a_success_resets() -> None:
    memory, p = PodHealth(was_healthy=True), pod(0, 0)
    bad = ProbeOutcome(False, "timeout")
    assert not observe(memory, p, bad, 3, now=1.0)
    assert not observe(memory, p, bad, 3, now=2.0)
    assert not observe(memory, p, ProbeOutcome(True), 3, now=3.0)
    assert memory.failures == 0 and memory.failed_since is None
    for t in (4.0, 5.0):
        assert not observe(memory, p, bad, 3, now=t)
    assert observe(memory, p, bad, 3, now=6.0)
    assert memory.failed_since == 4.0


def test_a_container_restart_fails_the_pod_at_once_but_a_starting_pod_is_not_probed() -> None:
    memory = PodHealth()
    assert not observe(memory, pod(0, 0, restarts=0), None, 3, now=1.0)
    assert observe(memory, pod(0, 0, restarts=1), None, 3, now=2.0)
    assert "restarted" in memory.last_reason


def test_a_pod_that_ended_fails_at_once_with_the_kubelets_reason() -> None:
    """A Failed pod (the kubelet rejected it, say for lack of GPUs) is the prober's to replace, within budget."""
    memory = PodHealth()
    rejected = ObservedPod(
        **{**pod(0, 0).__dict__, "phase": "Failed", "ready": False, "ended": "OutOfnvidia.com/gpu: no GPUs"}
    )
    assert observe(memory, rejected, None, 3, now=1.0)
    assert memory.last_reason == "pod Failed: OutOfnvidia.com/gpu: no GPUs"
    assert memory.failed_since == 1.0, "the backoff counts from the first time it was seen failed"
    assert observe(memory, rejected, None, 3, now=2.0) and memory.failed_since == 1.0
    assert observe(PodHealth(), pod(0, 0, phase="Succeeded"), None, 3, now=1.0)


def test_replica_policy_takes_every_rank_of_the_replica() -> None:
    pods = [pod(0, 0), pod(0, 1), pod(1, 0), pod(1, 1)]
    assert [p.name for p in pods_to_replace(pods[1], pods, "Replica")] == ["g-r0-w0", "g-r0-w1"]
    assert [p.name for p in pods_to_replace(pods[1], pods, "Pod")] == ["g-r0-w1"]


def test_backoff_doubles_up_to_the_maximum() -> None:
    spec = HealthSpec(backoff_seconds=2, max_backoff_seconds=10)
    assert [backoff_delay(n, spec) for n in range(5)] == [2, 4, 8, 10, 10]
    assert backoff_delay(3, HealthSpec(backoff_seconds=0)) == 0


def test_restart_budget_waits_for_backoff_then_replaces_then_is_exhausted() -> None:
    spec = HealthSpec(backoff_seconds=5, max_backoff_seconds=60, max_restarts=2, restart_window_seconds=60)
    assert restart_decision([], [], failed_since=100, now=101, spec=spec).action == "wait"
    assert restart_decision([], [], failed_since=100, now=105, spec=spec).action == "replace"
    # the second restart of the same replica waits twice as long
    assert restart_decision([105], [105], failed_since=110, now=115, spec=spec).action == "wait"
    assert restart_decision([105], [105], failed_since=110, now=120, spec=spec).action == "replace"
    exhausted = restart_decision([105, 120], [105, 120], failed_since=130, now=140, spec=spec)
    assert exhausted.action == "exhausted" and "maxRestarts=2" in exhausted.message
    # once the window has passed the budget is there again
    assert restart_decision([105, 120], [], failed_since=170, now=181, spec=spec).action == "replace"


@pytest.mark.parametrize(
    "existing", [None, {"nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]}]
)
def test_replacements_avoid_faulty_nodes(existing: dict[str, object] | None) -> None:
    manifest: dict[str, object] = {"spec": {}}
    if existing:
        manifest["spec"] = {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": existing}}
        }
    result = avoid_nodes(manifest, {"n2", "n1"})
    terms = result["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]  # type: ignore[index]
    for term in terms:
        assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]} in term[
            "matchExpressions"
        ]
    assert avoid_nodes({"spec": {}}, set()) == {"spec": {}}


def test_avoid_list_is_bounded_and_expires() -> None:
    entries: list[dict[str, Any]] = []
    for minute in range(20):
        entries = avoid_after_fault(entries, f"n{minute}", f"2026-01-01T00:{minute:02d}:00Z")
    assert len(entries) == MAX_AVOIDED_NODES
    assert entries[0]["node"] == "n4" and entries[-1] == {"node": "n19", "since": "2026-01-01T00:19:00Z"}
    again = avoid_after_fault(entries, "n4", "2026-01-01T00:30:00Z")
    assert [e["node"] for e in again].count("n4") == 1 and again[-1]["node"] == "n4"
    assert [e["node"] for e in current_avoided(entries, "2026-01-01T01:10:30Z")] == [
        f"n{m}" for m in range(11, 20)
    ]
    assert current_avoided(entries, "2026-01-01T02:00:00Z") == []
    assert current_avoided([{"node": "x", "since": "not a time"}, "junk"], "2026-01-01T00:00:00Z") == []  # type: ignore[list-item]
