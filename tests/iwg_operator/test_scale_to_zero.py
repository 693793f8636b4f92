"""Scale to zero and back (issue 25), the operator's pure parts: the autoscaler brings a group at zero to one
replica as soon as a driver holds a request, takes a group with minReplicas 0 to zero only after
scaleToZeroAfterSeconds without any request, and the status calls a group at 0/0 Idle."""

from __future__ import annotations

from iwg_operator import status
from iwg_operator.autoscaling.policy import DriverSample, combine_samples, parse_driver_metrics
from iwg_operator.autoscaling.scaler import GroupScaler
from iwg_operator.planning import Desired, plan_pods
from iwg_worker.driver.metrics import DriverMetrics

from tests.iwg_operator.test_autoscaling_policy import spec
from tests.iwg_operator.test_planning import REV, full


def sample(at: float, answered: float = 0.0, held: float = 0.0, inflight: float = 0.0) -> DriverSample:
    return DriverSample(at, 0.0, inflight, activation_waiting=held, requests_total=answered)


def test_the_drivers_held_requests_and_answered_requests_are_read_from_their_own_metrics() -> None:
    metrics = DriverMetrics()  # the driver's own registry, so the names cannot drift apart
    metrics.activation_waiting.set(3)
    metrics.requests.labels(endpoint="chat_completions", status="200").inc(5)
    metrics.requests.labels(endpoint="embeddings", status="503").inc(2)
    one = parse_driver_metrics(metrics.render().decode(), 1.0)
    assert (one.activation_waiting, one.requests_total) == (3.0, 7.0)
    both = combine_samples({"a#0": one, "b#0": sample(2.0, answered=1.0, held=2.0)})
    assert (both.activation_waiting, both.requests_total) == (5.0, 8.0)  # each driver holds its own


def test_a_held_request_brings_a_group_at_zero_to_one_replica_at_once() -> None:
    s = spec(min_replicas=0, scale_up_stabilization_seconds=600)
    scaler = GroupScaler()
    quiet = scaler.decide(sample(100.0), None, 0, s)
    assert (quiet.replicas, quiet.reason) == (0, "Idle")
    up = scaler.decide(sample(105.0, held=4.0), None, 0, s)  # the first sample that shows it: no window
    assert (up.replicas, up.reason, up.event) == (1, "ScaledFromZero", "ScaledFromZero")
    assert "4 request(s) held" in up.message


def test_with_min_replicas_zero_only_idleness_takes_the_group_to_zero() -> None:
    s = spec(min_replicas=0, scale_down_stabilization_seconds=10, scale_to_zero_after_seconds=60)
    scaler = GroupScaler()
    decisions = []
    answered = 0.0
    for t in range(0, 60, 5):  # a request answered now and then, between the scrapes: never busy at a scrape
        answered += 1 if t % 20 == 0 else 0
        decisions.append(scaler.decide(sample(100.0 + t, answered=answered), None, 2, s))
    # The metric (queueDepth 0) asks for fewer replicas: down to 1 after the window, never to 0 while used.
    assert {d.replicas for d in decisions} <= {1, 2} and decisions[-1].replicas == 1
    last_use = 100.0 + 40
    for t in range(45, 130, 5):
        decision = scaler.decide(sample(100.0 + t, answered=answered), None, 1, s)
        if 100.0 + t - last_use < 60:
            assert decision.replicas == 1, t
        else:
            assert (decision.replicas, decision.reason, decision.event) == (0, "Idle", "ScaledToZero"), t
            assert "no request for 60 s" in decision.message
            break
    else:
        raise AssertionError("never scaled to zero")


def test_a_request_in_flight_or_held_keeps_the_group_up() -> None:
    s = spec(min_replicas=0, scale_to_zero_after_seconds=10)
    scaler = GroupScaler()
    for t in range(0, 60, 5):
        busy = sample(100.0 + t, inflight=1.0) if t % 2 == 0 else sample(100.0 + t, held=1.0)
        assert scaler.decide(busy, None, 1, s).replicas != 0
    # Without minReplicas 0 an idle group stays at its minimum.
    plain = GroupScaler()
    assert {plain.decide(sample(100.0 + t), None, 1, spec()).replicas for t in range(0, 600, 60)} == {1}


def test_a_group_at_zero_replicas_with_no_pod_left_is_idle() -> None:
    desired = Desired(0, 1, REV, 1)
    idle = status.group_status("g", 2, desired, [], plan_pods(desired, []), None, "t")
    assert (idle["phase"], idle["replicas"], idle["readyReplicas"]) == ("Idle", 0, 0)
    conditions = {c["type"]: c for c in idle["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Degraded"]["status"] == "False"
    # Replicas still leaving (draining to zero): not idle yet.
    leaving = full(1, 1)
    going = status.group_status("g", 2, desired, leaving, plan_pods(desired, leaving), None, "t")
    assert going["phase"] != "Idle"
