"""examples/minilm.yaml, applied with kubectl, serves real embeddings through the operator's wiring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from iwg_operator.api.v1alpha1 import load_manifest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.harness import (
    diagnose,
    driver_address,
    eventually,
    live_ready_workers,
    openai_client,
    pod_ready,
)
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minilm.yaml"
READY_TIMEOUT = 120


def test_example_group_answers_a_real_embedding_request_through_its_driver(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    control_plane.kubectl("apply", "-n", workspace, "-f", str(EXAMPLE))
    manifest = load_manifest(EXAMPLE)
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = manifest.name
    try:
        eventually(
            lambda: (groups.get(name).get("status") or {}).get("readyReplicas") == 2,
            READY_TIMEOUT,
            "both replicas ready",
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{diagnose(node_agent, core, workspace)}") from None
    workers = live_ready_workers(core, workspace, name)
    assert {p.spec.node_name for p in workers} <= set(node_agent.nodes)
    address = eventually(
        lambda: driver_address(node_agent.gateway, workspace, name),
        60,
        "the driver Service to resolve",
        tolerate=(OSError,),  # a DNS answer late on a loaded machine: ask again
    )
    driver = eventually(
        lambda: [
            p
            for p in core.list_namespaced_pod(
                workspace, label_selector="app.kubernetes.io/component=driver"
            ).items
            if pod_ready(p)
        ],
        READY_TIMEOUT,
        "the driver ready",
    )[0]
    assert driver.status.pod_ip == address

    sentences = ["The operator replaced the failed worker.", "A cat sat on the mat."]
    api = openai_client(address)
    result = api.embeddings.create(model=manifest.served_name, input=sentences)
    got = np.array([d.embedding for d in result.data])

    from sentence_transformers import SentenceTransformer

    oracle = SentenceTransformer(str(manifest.spec.model.resolved_path()), device="cpu")
    expected = oracle.encode(sentences, normalize_embeddings=True)
    cosine = (got * expected).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert got.shape == (2, 384)
    assert cosine.min() >= 0.9999, cosine

    table = control_plane.kubectl("get", "iwg", "-n", workspace).stdout
    assert name in table and "Running" in table, table
