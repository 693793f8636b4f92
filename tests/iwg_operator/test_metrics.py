"""The operator's Prometheus metrics: what each helper records, and the endpoint that serves them."""

from __future__ import annotations

import asyncio
import inspect
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from iwg_operator import metrics
from prometheus_client.parser import text_string_to_metric_families


def _value(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
def server() -> Iterator[metrics.MetricsServer]:
    served = metrics.serve(0, "127.0.0.1")
    try:
        yield served
    finally:
        served.close()


def _scrape(server: metrics.MetricsServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_the_endpoint_serves_every_operator_metric(server: metrics.MetricsServer) -> None:
    with metrics.reconcile("test-endpoint"):
        pass
    with pytest.raises(KeyError), metrics.reconcile("test-endpoint"):
        raise KeyError("x")
    metrics.group_phase("ns", "endpoint-group", "Running")
    metrics.pod_created("scale-up", 2)
    metrics.pod_replaced("unhealthy")
    metrics.autoscaler_decision("up")
    metrics.api_request("create", "pods", 201)
    scraped = _scrape(server)
    for name in metrics.METRIC_NAMES:
        sample = name if not name.endswith("_seconds") else f"{name}_count"
        assert sample in scraped, f"{name} is not on /metrics"
        assert name.startswith("iwg_operator_")
    api = {
        tuple(sorted(labels.items())): value for labels, value in scraped["iwg_operator_api_requests_total"]
    }
    assert api[(("code", "201"), ("resource", "pods"), ("verb", "create"))] >= 1
    assert "process_resident_memory_bytes" in scraped


def test_reconcile_counts_runs_errors_and_time() -> None:
    before = _value("iwg_operator_reconciles_total", handler="h1")
    errors_before = _value("iwg_operator_reconcile_errors_total", handler="h1", error="RuntimeError")
    timed_before = _value("iwg_operator_reconcile_duration_seconds_count", handler="h1")
    with metrics.reconcile("h1"):
        pass
    with pytest.raises(RuntimeError), metrics.reconcile("h1"):
        raise RuntimeError("boom")
    assert _value("iwg_operator_reconciles_total", handler="h1") == before + 2
    assert (
        _value("iwg_operator_reconcile_errors_total", handler="h1", error="RuntimeError") == errors_before + 1
    )
    assert _value("iwg_operator_reconcile_duration_seconds_count", handler="h1") == timed_before + 2


def test_timed_keeps_the_handler_signature_and_measures_it() -> None:
    async def handler(*, name: str, namespace: str, **_: object) -> str:
        await asyncio.sleep(0.02)
        return f"{namespace}/{name}"

    wrapped = metrics.timed("h2")(handler)
    # Kopf passes keyword arguments by name: the wrapper must keep them visible.
    assert inspect.signature(wrapped) == inspect.signature(handler)
    before = _value("iwg_operator_reconcile_duration_seconds_sum", handler="h2")
    assert asyncio.run(wrapped(name="g", namespace="ns")) == "ns/g"
    assert _value("iwg_operator_reconcile_duration_seconds_sum", handler="h2") - before >= 0.02


def test_groups_are_counted_by_phase_and_a_phase_left_empty_reads_zero() -> None:
    metrics.group_phase("p", "a", "Pending")
    metrics.group_phase("p", "b", "Pending")
    metrics.group_phase("p", "c", "Degraded")
    assert _value("iwg_operator_groups", phase="Pending") >= 2
    pending = _value("iwg_operator_groups", phase="Pending")
    metrics.group_phase("p", "a", "Running")
    assert _value("iwg_operator_groups", phase="Pending") == pending - 1
    metrics.group_gone("p", "c")
    metrics.group_gone("p", "c")  # forgetting twice is harmless
    assert metrics.REGISTRY.get_sample_value("iwg_operator_groups", {"phase": "Degraded"}) == 0


def test_the_port_comes_from_the_flag_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(metrics.PORT_ENV, raising=False)
    assert metrics.port_from_env() is None
    monkeypatch.setenv(metrics.PORT_ENV, "9123")
    assert metrics.port_from_env() == 9123
    assert metrics.port_from_env(9200) == 9200
    monkeypatch.setenv(metrics.PORT_ENV, "nine")
    with pytest.raises(ValueError, match=metrics.PORT_ENV):
        metrics.port_from_env()


def test_the_operations_page_lists_every_metric() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    listed = set(re.findall(r"`(iwg_operator_\w+)`", page))
    assert listed == set(metrics.METRIC_NAMES), listed ^ set(metrics.METRIC_NAMES)
