"""Pure planning and status: scale up/down, rolling replacement, terminating names, conditions."""

from __future__ import annotations

from iwg_operator import labels, status
from iwg_operator.planning import (
    Desired,
    ObservedDriver,
    ObservedPod,
    ObservedPodGroup,
    loose_replicas,
    observe_driver_pod,
    observe_pod,
    observe_pod_group,
    plan_gang,
    plan_pods,
    replacing_replicas,
)

REV = "r1"


def pod(replica: int, rank: int, revision: str = REV, ready: bool = True, **extra: object) -> ObservedPod:
    return ObservedPod(
        name=f"g-r{replica}-w{rank}", group="g", replica=replica, rank=rank, revision=revision, ready=ready,
        phase="Running", uid=f"u{replica}-{rank}", **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def full(replicas: int, world: int, revision: str = REV) -> list[ObservedPod]:
    return [pod(r, k, revision) for r in range(replicas) for k in range(world)]


def test_fresh_group_creates_every_rank() -> None:
    plan = plan_pods(Desired(2, 3, REV, 1), [])
    assert plan.create == tuple((r, k) for r in range(2) for k in range(3))
    assert plan.delete == ()


def test_settled_group_plans_nothing() -> None:
    plan = plan_pods(Desired(2, 2, REV, 1), full(2, 2))
    assert plan.empty and not plan.waiting_for_termination


def test_scale_down_removes_highest_replicas_first() -> None:
    plan = plan_pods(Desired(1, 2, REV, 1), full(3, 2))
    assert [p.replica for p in plan.delete] == [2, 2, 1, 1]
    assert plan.scale_down == (2, 1)
    assert plan.create == ()


def test_scale_up_adds_only_new_replicas() -> None:
    plan = plan_pods(Desired(3, 2, REV, 1), full(1, 2))
    assert plan.create == ((1, 0), (1, 1), (2, 0), (2, 1))


def test_rolling_replaces_at_most_max_unavailable_replicas() -> None:
    plan = plan_pods(Desired(4, 2, "r2", 1), full(4, 2, REV))
    assert plan.replace == (3,)
    assert {p.replica for p in plan.delete} == {3}
    plan = plan_pods(Desired(4, 2, "r2", 2), full(4, 2, REV))
    assert plan.replace == (3, 2)


def test_a_rollout_drains_every_replica_it_replaces() -> None:
    plan = plan_pods(Desired(2, 1, "r2", 1), full(2, 1, REV))
    assert plan.replace == plan.rolled == (1,)
    # An outdated replica whose pod is not ready is replaced first, and drained too: a probe it missed under
    # load does not mean the driver sends it nothing.
    plan = plan_pods(Desired(2, 1, "r2", 1), [pod(0, 0, REV), pod(1, 0, REV, ready=False)])
    assert plan.replace == plan.rolled == (1,)
    # With room for both, the serving one goes too, drained as well.
    plan = plan_pods(Desired(2, 1, "r2", 2), [pod(0, 0, REV), pod(1, 0, REV, ready=False)])
    assert plan.replace == plan.rolled == (1, 0)


def test_one_replica_with_max_surge_serves_through_a_rollout() -> None:
    """Every step of a rollout of 1 replica with maxSurge 1: some replica serves at each."""
    desired = Desired(1, 2, "r2", 1, max_surge=1)
    # 1. The surge replica (index 1) is made first; the old replica stays.
    plan = plan_pods(desired, full(1, 2, REV))
    assert plan.create == ((1, 0), (1, 1)) and plan.delete == () and plan.extent == 2
    # 2. Until it serves, nothing is replaced.
    starting = [*full(1, 2, REV), pod(1, 0, "r2"), pod(1, 1, "r2", ready=False)]
    assert plan_pods(desired, starting).empty
    # 3. It serves: the old replica is drained and replaced.
    surged = [*full(1, 2, REV), pod(1, 0, "r2"), pod(1, 1, "r2")]
    plan = plan_pods(desired, surged)
    assert plan.replace == plan.rolled == (0,) and {p.replica for p in plan.delete} == {0}
    assert plan.scale_down == ()
    # 4. While the new replica 0 starts, the surge stays.
    starting = [pod(0, 0, "r2"), pod(0, 1, "r2", ready=False), pod(1, 0, "r2"), pod(1, 1, "r2")]
    plan = plan_pods(desired, starting)
    assert plan.empty and plan.extent == 2
    # 5. Replica 0 serves the new revision: the surge leaves like a scale-down (drained first).
    plan = plan_pods(desired, full(2, 2, "r2"))
    assert plan.scale_down == (1,) and {p.replica for p in plan.delete} == {1} and plan.extent == 1
    # Settled, a group with maxSurge has no extra replica.
    assert plan_pods(desired, full(1, 2, "r2")).empty


def test_max_unavailable_counts_the_surge() -> None:
    # 3 replicas + 1 surge, maxUnavailable 2: the surge starting uses one, so one old replica may go.
    pods = [*full(3, 1, REV)]
    plan = plan_pods(Desired(3, 1, "r2", 2, max_surge=1), pods)
    assert plan.create == ((3, 0),) and plan.rolled == (2,)


def test_rolling_waits_while_a_replica_is_unavailable() -> None:
    pods = [*full(3, 1, REV), pod(3, 0, "r2", ready=False)]
    plan = plan_pods(Desired(4, 1, "r2", 1), pods)
    assert plan.replace == ()
    pods = [*full(3, 1, REV), pod(3, 0, "r2", ready=True)]
    assert plan_pods(Desired(4, 1, "r2", 1), pods).replace == (2,)


def test_terminating_pod_blocks_its_name() -> None:
    pods = [pod(0, 0, terminating=True), pod(0, 1)]
    plan = plan_pods(Desired(1, 2, REV, 1), pods)
    assert plan.create == () and plan.waiting_for_termination


def test_world_size_change_replaces_whole_replicas() -> None:
    plan = plan_pods(Desired(1, 4, "r2", 1), full(1, 2, REV))
    assert plan.replace == (0,) and len(plan.delete) == 2 and plan.create == ()
    gone = [pod(0, 0, REV, terminating=True), pod(0, 1, REV, terminating=True)]
    assert plan_pods(Desired(1, 4, "r2", 1), gone).create == ((0, 2), (0, 3))


def test_missing_rank_is_recreated_and_a_failed_pod_is_left_to_the_restart_budget() -> None:
    plan = plan_pods(Desired(1, 3, REV, 1), [pod(0, 0), pod(0, 2)])
    assert plan.create == ((0, 1),)
    # A Failed pod (the kubelet rejected or evicted it) keeps its name: the health prober replaces it within
    # spec.health's budget and backoff; deleting it here recreated it at once, in a loop.
    for phase in ("Failed", "Succeeded"):
        ended = ObservedPod(name="g-r0-w1", group="g", replica=0, rank=1, revision=REV, phase=phase, uid="x")
        assert ended.terminal
        plan = plan_pods(Desired(1, 2, REV, 1), [pod(0, 0), ended])
        assert plan.empty, plan
    # Scale-down and rollouts still remove ended pods with the rest of their replica.
    failed = ObservedPod(name="g-r1-w0", group="g", replica=1, rank=0, revision=REV, phase="Failed", uid="y")
    assert plan_pods(Desired(1, 1, REV, 1), [pod(0, 0), failed]).delete == (failed,)
    outdated = ObservedPod(
        name="g-r0-w0", group="g", replica=0, rank=0, revision="old", phase="Failed", uid="z"
    )
    assert plan_pods(Desired(1, 1, REV, 1), [outdated]).delete == (outdated,)


def test_a_replica_that_lost_a_rank_is_torn_down_with_restart_policy_replica() -> None:
    whole = Desired(2, 2, REV, 1, whole_replicas=True)
    # Rank 1 of replica 1 evicted (terminating) or already gone beside a Ready rank 0: rank 0 goes too, and
    # nothing is created for the replica until every rank of it is gone; replica 0 is left alone.
    for lost in ([pod(1, 1, terminating=True)], []):
        plan = plan_pods(whole, [*full(1, 2), pod(1, 0), *lost])
        assert plan.torn_down == (1,) and plan.replace == (1,), plan
        assert [p.name for p in plan.delete] == ["g-r1-w0"] and plan.create == (), plan
    gone = [*full(1, 2), pod(1, 0, terminating=True), pod(1, 1, terminating=True)]
    assert plan_pods(whole, gone).create == () and plan_pods(whole, full(1, 2)).create == ((1, 0), (1, 1))
    # The old ranks leave one at a time (each its grace period): none of the new ones is made until the last
    # old one is gone, or it would be torn down beside the one still terminating, over and over.
    three = Desired(1, 3, REV, 1, whole_replicas=True)
    for leaving in (
        [pod(0, 0, terminating=True), pod(0, 2, terminating=True)],
        [pod(0, 2, terminating=True)],
    ):
        plan = plan_pods(three, leaving)
        assert plan.create == () and plan.delete == () and plan.waiting_for_termination, plan
    assert plan_pods(three, []).create == ((0, 0), (0, 1), (0, 2))
    # Replaced rank by rank (restartPolicy Pod), a missing rank is made beside one still terminating.
    assert plan_pods(Desired(1, 3, REV, 1), [pod(0, 0), pod(0, 2, terminating=True)]).create == ((0, 1),)
    # A rank missing beside ranks not Ready yet is still to be created; restartPolicy Pod and worldSize 1 keep
    # the running ranks; nothing is torn down in a whole group.
    assert plan_pods(whole, [*full(1, 2), pod(1, 0, ready=False)]).create == ((1, 1),)
    assert plan_pods(Desired(2, 2, REV, 1), [*full(1, 2), pod(1, 0)]).create == ((1, 1),)
    assert plan_pods(Desired(2, 1, REV, 1, whole_replicas=True), full(1, 1)).create == ((1, 0),)
    assert plan_pods(whole, full(2, 2)).empty


def test_observe_pod_says_why_a_pod_ended() -> None:
    body = {
        "metadata": {
            "name": "g-r0-w0",
            "uid": "u",
            "labels": {labels.GROUP: "g", labels.REPLICA: "0", labels.RANK: "0", labels.REVISION: REV},
        },
        "status": {
            "phase": "Failed",
            "reason": "UnexpectedAdmissionError",
            "message": "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu",
        },
    }
    observed = observe_pod(body)
    assert observed is not None and observed.terminal
    assert observed.ended == (
        "UnexpectedAdmissionError: Allocate failed due to requested number of devices unavailable for "
        "nvidia.com/gpu"
    )
    running = observe_pod({**body, "status": {"phase": "Running", "reason": "x"}})
    assert running is not None and not running.terminal and running.ended is None


def test_observe_pod_reads_labels_readiness_and_scheduler_message() -> None:
    body = {
        "metadata": {
            "name": "g-r1-w0",
            "uid": "u",
            "labels": {"inference.iwg.dev/group": "g", "inference.iwg.dev/replica": "1", "inference.iwg.dev/rank": "0",
                       "inference.iwg.dev/revision": REV},
        },
        "spec": {},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes: gpu"}]},
    }  # fmt: skip
    observed = observe_pod(body)
    assert observed is not None
    assert (observed.replica, observed.rank, observed.ready) == (1, 0, False)
    assert observed.unschedulable == "0/4 nodes: gpu"
    assert observe_pod({"metadata": {"labels": {}}}) is None


def test_status_counts_conditions_and_is_stable() -> None:
    desired = Desired(2, 2, REV, 1)
    pods = full(2, 2)
    plan = plan_pods(desired, pods)
    first = status.group_status("g", 3, desired, pods, plan, None, "t1")
    assert (first["phase"], first["replicas"], first["readyReplicas"]) == ("Running", 2, 2)
    assert first["selector"] == "app.kubernetes.io/component=worker,inference.iwg.dev/group=g"
    conditions = {c["type"]: c for c in first["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Ready"]["observedGeneration"] == 3
    again = status.group_status("g", 3, desired, pods, plan, first, "t2")
    assert not status.status_differs(first, again)


def test_driver_available_condition_follows_the_driver_pods() -> None:
    desired = Desired(1, 1, REV, 1)
    pods = full(1, 1)
    plan = plan_pods(desired, pods)

    def driver_condition(drivers: list[ObservedDriver], previous: object = None) -> dict[str, str]:
        result = status.group_status("g", 1, desired, pods, plan, previous, "t", drivers=drivers)  # type: ignore[arg-type]
        return {c["type"]: c for c in result["conditions"]}["DriverAvailable"]

    up = ObservedDriver("g-driver-a", "g", ready=True, terminating=False, restarts=0)
    down = ObservedDriver("g-driver-a", "g", ready=False, terminating=False, restarts=1)
    leaving = ObservedDriver("g-driver-b", "g", ready=True, terminating=True, restarts=0)
    assert (driver_condition([up])["status"], driver_condition([up])["message"]) == (
        "True", "1/1 driver pod(s) ready"
    )  # fmt: skip
    lost = driver_condition([down, leaving])
    assert (lost["status"], lost["reason"]) == ("False", "DriverDown")
    assert lost["message"] == "no driver pod ready: g-driver-a (restarts 1)"
    assert driver_condition([])["reason"] == "NoDriverPod"
    # Not looked at: no condition at all.
    result = status.group_status("g", 1, desired, pods, plan, None, "t")
    assert "DriverAvailable" not in {c["type"] for c in result["conditions"]}
    body = {
        "metadata": {"name": "g-driver-a", "labels": {labels.GROUP: "g"}},
        "status": {
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"restartCount": 2}],
        },
    }
    assert observe_driver_pod(body) == ObservedDriver("g-driver-a", "g", False, False, 2)
    assert observe_driver_pod({"metadata": {"labels": {}}}) is None


REFUSAL = (
    "iwg_worker.models.sharding.ShardingRefused: worldSize 2 cannot shard architecture LlamaForCausalLM: it has "
    "9 attention heads, 3 key/value heads, MLP intermediate size 1536, and each must divide evenly across the "
    "ranks; world sizes that divide them all: 1, 3"
)


def test_observe_pod_reads_why_its_worker_ended_with_an_error() -> None:
    def body(**container: object) -> dict[str, object]:
        labels_ = {
            "inference.iwg.dev/group": "g",
            "inference.iwg.dev/replica": "0",
            "inference.iwg.dev/rank": "1",
        }
        return {
            "metadata": {"name": "g-r0-w1", "labels": labels_},
            "status": {"containerStatuses": [container]},
        }

    # The end of the worker's log: the traceback, the reason, then whatever other threads still wrote.
    log_tail = (
        f"Traceback (most recent call last):\n  ...\n{REFUSAL}\n"
        f"2026-12-03 12:00:00 ERROR iwg_worker.worker_proc [pid 7] worker failed to start: {REFUSAL}\n"
        "Exception occurred during processing of request from ('10.0.0.1', 47174)\n\n"
    )
    crashed = body(
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        lastState={"terminated": {"exitCode": 1, "message": log_tail}},
    )
    observed = observe_pod(crashed)
    assert observed is not None and observed.failure == f"worker failed to start: {REFUSAL}"
    silent = body(state={"terminated": {"exitCode": 137}})
    assert observe_pod(silent).failure == "exited with code 137"  # type: ignore[union-attr]
    # No marked line: the last line that says something, not the rule a log printer drew under it.
    ruled = body(state={"terminated": {"exitCode": 1, "message": "RuntimeError: out of memory\n-----\n  \n"}})
    assert observe_pod(ruled).failure == "RuntimeError: out of memory"  # type: ignore[union-attr]
    done = body(state={"running": {}}, lastState={"terminated": {"exitCode": 0, "message": "bye"}})
    assert observe_pod(done).failure is None  # type: ignore[union-attr]


def test_status_names_why_workers_failed() -> None:
    desired = Desired(1, 2, REV, 1)
    why = f"worker failed to start: {REFUSAL}"
    pods = [pod(0, 0, ready=False, failure=why), pod(0, 1, ready=False, failure=why)]
    result = status.group_status("g", 1, desired, pods, plan_pods(desired, pods), None, "t")
    degraded = {c["type"]: c for c in result["conditions"]}["Degraded"]
    assert result["phase"] == "Pending"
    assert (degraded["status"], degraded["reason"]) == ("True", "WorkerFailed")
    assert f"worker g-r0-w0 failed: {why}" in degraded["message"]
    assert "LlamaForCausalLM" in degraded["message"] and "9 attention heads" in degraded["message"]
    # Serving again, an old failure is no longer the group's problem.
    healthy = [pod(0, 0, failure=why), pod(0, 1, failure=why)]
    result = status.group_status("g", 1, desired, healthy, plan_pods(desired, healthy), None, "t")
    assert {c["type"]: c for c in result["conditions"]}["Degraded"]["status"] == "False"


def test_status_reports_unschedulable_with_the_scheduler_message() -> None:
    desired = Desired(1, 1, REV, 1)
    pods = [pod(0, 0, ready=False, unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")]
    result = status.group_status("g", 1, desired, pods, plan_pods(desired, pods), None, "t")
    conditions = {c["type"]: c for c in result["conditions"]}
    assert result["phase"] == "Pending"
    assert conditions["Unschedulable"]["status"] == "True"
    assert "Insufficient nvidia.com/gpu" in conditions["Unschedulable"]["message"]
    assert conditions["Degraded"]["reason"] == "Unschedulable"


def test_status_calls_pods_placed_only_when_bound_and_reports_those_no_scheduler_picked_up() -> None:
    desired = Desired(1, 2, REV, 1)
    created = "2026-01-01T00:00:00Z"
    pods = [pod(0, 0, ready=False, created=created), pod(0, 1, ready=False, created=created, node="n1")]
    plan = plan_pods(desired, pods)

    def unschedulable(now: str) -> dict[str, object]:
        result = status.group_status("g", 1, desired, pods, plan, None, now, None, "gang", 60)
        return {c["type"]: c for c in result["conditions"]}["Unschedulable"]

    early = unschedulable("2026-01-01T00:00:30Z")
    assert (early["status"], early["reason"]) == ("False", "Scheduling")
    assert "1 pod(s) waiting" in str(early["message"])
    assert status.scheduling_recheck(pods, "2026-01-01T00:00:30Z", 60) == 30
    late = unschedulable("2026-01-01T00:01:00Z")
    assert (late["status"], late["reason"]) == ("True", "NotScheduled")
    assert "spec.scheduling.schedulerName 'gang'" in str(late["message"])
    assert status.scheduling_recheck(pods, "2026-01-01T00:01:00Z", 60) is None
    seen = [pod(0, 0, ready=False, created=created, seen_by_scheduler=True), pods[1]]
    result = status.group_status("g", 1, desired, seen, plan, None, "2026-01-01T00:05:00Z", None, "gang", 60)
    assert {c["type"]: c for c in result["conditions"]}["Unschedulable"]["reason"] == "Scheduling"
    bound = [pod(0, 0, node="n1"), pod(0, 1, node="n2")]
    result = status.group_status(
        "g", 1, desired, bound, plan_pods(desired, bound), None, "t", None, "gang", 60
    )
    assert {c["type"]: c for c in result["conditions"]}["Unschedulable"][
        "message"
    ] == "all pods bound to nodes"


# ---------------------------------------------------------------------------------------------- gang placement


def gang(replica: int, min_count: int = 2, terminating: bool = False, **extra: object) -> ObservedPodGroup:
    return ObservedPodGroup(
        name=f"g-r{replica}", group="g", replica=replica, min_count=min_count, uid=f"pg{replica}",
        terminating=terminating, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_gang_podgroups_come_with_the_replicas_that_get_pods() -> None:
    desired = Desired(2, 2, REV, 1)
    plan = plan_pods(desired, [])
    made = plan_gang(desired, True, [], plan)
    assert made.create == (0, 1) and made.delete == () and made.held == frozenset()
    assert plan_gang(desired, True, [gang(0), gang(1)], plan_pods(desired, full(2, 2))).empty


def test_gang_scale_down_and_rollout_delete_their_podgroups() -> None:
    scaled = Desired(1, 2, REV, 1)
    made = plan_gang(scaled, True, [gang(0), gang(1), gang(2)], plan_pods(scaled, full(3, 2)))
    assert [g.replica for g in made.delete] == [2, 1] and made.create == ()
    rolled = Desired(2, 2, "r2", 1)
    plan = plan_pods(rolled, full(2, 2))
    made = plan_gang(rolled, True, [gang(0), gang(1)], plan)
    assert [g.replica for g in made.delete] == list(plan.replace) == [1]
    assert made.held == frozenset({1})


def test_a_podgroup_being_deleted_replaces_the_replica_and_holds_its_pods() -> None:
    desired = Desired(2, 2, REV, 1)
    groups = [gang(0), gang(1, terminating=True)]
    plan = plan_pods(desired, full(2, 2), replacing_replicas(groups))
    assert {p.name for p in plan.delete} == {"g-r1-w0", "g-r1-w1"} and plan.create == ()
    # Its pods gone, the PodGroup still finalizing: nothing is created for the replica yet.
    pods = full(1, 2)
    plan = plan_pods(desired, pods, replacing_replicas(groups))
    assert plan.create == ()
    assert plan_gang(desired, True, groups, plan).held == frozenset({1})
    # Gone: the replica gets a new PodGroup and its pods.
    plan = plan_pods(desired, pods, replacing_replicas([gang(0)]))
    assert plan.create == ((1, 0), (1, 1))
    assert plan_gang(desired, True, [gang(0)], plan).create == (1,)


def test_gang_off_or_a_wrong_min_count_deletes_podgroups() -> None:
    desired = Desired(2, 2, REV, 1)
    plan = plan_pods(desired, full(2, 2))
    off = plan_gang(desired, False, [gang(0), gang(1)], plan)
    assert len(off.delete) == 2 and off.held == frozenset() and not off.active
    stale = plan_gang(desired, True, [gang(0), gang(1, min_count=4)], plan)
    assert [g.replica for g in stale.delete] == [1]


def test_replicas_placed_without_a_gang_get_no_podgroup_until_they_are_replaced() -> None:
    desired = Desired(2, 2, REV, 1)
    pods = [*full(1, 2), pod(1, 0, pod_group="g-r1")]  # replica 0 loose; replica 1 a gang, a rank missing
    loose = loose_replicas(pods, REV)
    assert loose == frozenset({0})
    plan = plan_pods(desired, pods)
    made = plan_gang(desired, True, [], plan, loose)
    assert made.create == (1,) and made.loose == frozenset({0})
    # A replica being replaced (rollout) is not loose: its new pods are a gang; old-revision pods never are.
    rolled = Desired(2, 2, "r2", 1)
    assert loose_replicas(pods, "r2") == frozenset()
    plan = plan_pods(rolled, full(2, 2))
    assert plan.replace and plan_gang(rolled, True, [], plan, frozenset(plan.replace)).loose == frozenset()
    # Gang placement not served: nothing is loose (no PodGroup is made at all).
    assert plan_gang(desired, False, [], plan_pods(desired, pods), loose).loose == frozenset()


def test_observe_pod_reads_the_podgroup_it_names() -> None:
    body = {
        "metadata": {"name": "g-r0-w1", "labels": {labels.GROUP: "g", labels.REPLICA: "0", labels.RANK: "1"}},
        "spec": {"schedulingGroup": {"podGroupName": "g-r0"}},
    }
    observed = observe_pod(body)
    assert observed is not None and observed.pod_group == "g-r0"
    body["spec"] = {}
    observed = observe_pod(body)
    assert observed is not None and observed.pod_group is None


def test_observe_pod_group_reads_the_schedulers_condition() -> None:
    body = {
        "metadata": {"name": "g-r0", "uid": "x", "labels": {labels.GROUP: "g", labels.REPLICA: "0"}},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 4}}},
        "status": {
            "conditions": [
                {
                    "type": "PodGroupInitiallyScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "pod group is unschedulable, minCount (4) cannot be satisfied",
                }
            ]
        },
    }
    observed = observe_pod_group(body)
    assert observed is not None and observed.min_count == 4 and observed.scheduled is False
    assert observed.message == "pod group is unschedulable, minCount (4) cannot be satisfied"
    assert observe_pod_group({"metadata": {"name": "x", "labels": {}}}) is None


def test_gang_status_per_replica_and_condition() -> None:
    desired = Desired(2, 2, REV, 1)
    pods = [
        pod(0, 0, node="n0"), pod(0, 1, node="n1"),
        pod(1, 0, ready=False, unschedulable="pod group is unschedulable"), pod(1, 1, ready=False),
    ]  # fmt: skip
    waiting = gang(1, scheduled=False, message="minCount (2) cannot be satisfied: 1 scheduled")
    result = status.group_status(
        "g", 1, desired, pods, plan_pods(desired, pods), None, "t", gang=status.Gang(True, (gang(0), waiting))
    )
    replicas = {r["index"]: r for r in result["replicaStatuses"]}
    assert replicas[0]["gang"] == "Placed" and "gangMessage" not in replicas[0]
    assert replicas[1]["gang"] == "Waiting"
    assert replicas[1]["gangMessage"] == "minCount (2) cannot be satisfied: 1 scheduled"
    condition = {c["type"]: c for c in result["conditions"]}["GangScheduling"]
    assert condition["status"] == "True" and condition["reason"] == "Waiting"
    assert condition["message"] == "replica 1: minCount (2) cannot be satisfied: 1 scheduled"

    unserved = status.group_status(
        "g", 1, desired, pods, plan_pods(desired, pods), None, "t", gang=status.Gang(False)
    )
    condition = {c["type"]: c for c in unserved["conditions"]}["GangScheduling"]
    assert condition["status"] == "False" and condition["reason"] == "ApiNotServed"
    assert "gang" not in unserved["replicaStatuses"][0]
    off = status.group_status("g", 1, desired, pods, plan_pods(desired, pods), unserved, "t")
    assert "GangScheduling" not in {c["type"] for c in off["conditions"]}


def test_a_replica_whose_ranks_belong_to_different_creations_is_torn_down_whatever_the_policy() -> None:
    """Ranks of different replica epochs meet in different rendezvous and never form a group: the replica is
    made again as a whole, under restartPolicy Pod too. Ranks that agree (epochs equal, or all 0: made before
    epochs) are left alone."""
    for whole in (False, True):
        desired = Desired(2, 2, REV, 1, whole_replicas=whole)
        pods = [pod(0, 0, epoch=5), pod(0, 1, epoch=5), pod(1, 0, epoch=7), pod(1, 1, epoch=8)]
        plan = plan_pods(desired, pods)
        assert plan.torn_down == (1,) and {p.name for p in plan.delete} == {"g-r1-w0", "g-r1-w1"}, plan
        assert plan.create == ()
        assert plan_pods(desired, [*pods[:2], pod(1, 0), pod(1, 1)]).empty
