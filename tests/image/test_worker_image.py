"""The worker image built from worker_image/Dockerfile (tests/image/build.sh) serves a group on a real kubelet.

`make image-test` builds the image (about 5.5 GB: torch with its CUDA libraries) and runs this module with
``IWG_WORKER_IMAGE_ARCHIVE`` naming it; `make test` skips it (a cold build does not fit CI's budget beside the
suite: docs/development.md, "The worker image"). The node here runs containers without the test environment
(no bind mount of this checkout, its venv or its Python, no extra env): the worker and the driver run the
image's own Python, packages and model (the MiniLM package the Dockerfile installs), as on any cluster.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.cluster.waiting import eventually
from tests.e2e.harness import group_manifest, live_ready_workers, openai_client
from tests.realnodes.fixture import RealCluster, real_cluster_running
from tests.realnodes.nodes import REPO_ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ARCHIVE_ENV = "IWG_WORKER_IMAGE_ARCHIVE"
IMAGE = "iwg.local/iwg-worker:dev"  # the name build.sh gives it
GROUP = "minilm"
READY_TIMEOUT = 300
TEXTS = ["Kubernetes schedules pods onto nodes with free GPUs.", "The worker image serves this sentence."]


@pytest.fixture(scope="module")
def image_cluster() -> Iterator[RealCluster]:
    archive = os.environ.get(ARCHIVE_ENV)
    if not archive:
        pytest.skip(f"{ARCHIVE_ENV} not set: `make image-test` builds the worker image and runs this test")
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (namespaces, cgroups, containerd)")
    with real_cluster_running(count=1, extra_images=(Path(archive),), test_environment=False) as cluster:
        yield cluster


def diagnose(cluster: RealCluster) -> str:
    lines = []
    for pod in cluster.core.list_namespaced_pod(cluster.namespace).items:
        lines.append(f"{pod.metadata.name} phase={pod.status.phase} {pod.status.container_statuses}")
        for container in pod.spec.containers:
            done = cluster.control_plane.kubectl(
                "logs",
                "-n",
                cluster.namespace,
                pod.metadata.name,
                "-c",
                container.name,
                "--tail",
                "20",
                check=False,
            )
            lines.append(done.stdout + done.stderr)
    lines += ["==== operator", cluster.operator_log(30)]
    return "\n".join(lines)


def test_the_built_worker_image_serves_embeddings_equal_to_sentence_transformers_own(
    image_cluster: RealCluster,
) -> None:
    cluster = image_cluster
    manifest = group_manifest(
        GROUP,
        replicas=1,
        worker={"image": IMAGE, "imagePullPolicy": "Never", "memory": "3Gi"},
        driver={"cpu": "500m"},
    )
    cluster.control_plane.kubectl("apply", "-n", cluster.namespace, "-f", "-", input=yaml.safe_dump(manifest))
    applied = time.monotonic()
    try:
        eventually(
            lambda: (cluster.groups.get(GROUP).get("status") or {}).get("readyReplicas") == 1,
            READY_TIMEOUT,
            "the replica ready",
            interval=1.0,
        )
        driver = cluster.ready_driver(GROUP, READY_TIMEOUT)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{diagnose(cluster)}") from None
    print(
        f"worker image: node start {', '.join(f'{k} {v:.1f} s' for k, v in cluster.nodes.timings.items())}; "
        "group applied to driver and replica ready "
        f"{time.monotonic() - applied:.1f} s",
        file=sys.__stderr__,
    )

    api = openai_client("127.0.0.1", cluster.nodes.forward(driver.status.pod_ip, 8000))
    served = api.embeddings.create(model=manifest["spec"]["model"]["servedName"], input=TEXTS)
    from sentence_transformers import SentenceTransformer

    from tests.iwg_worker.driver.conftest import minilm_path  # the package the image installed, on the host

    expected = SentenceTransformer(minilm_path(), device="cpu").encode(TEXTS, normalize_embeddings=True)
    for got, want in zip((d.embedding for d in served.data), expected, strict=True):
        vector = np.asarray(got)
        cosine = float(vector @ want / (np.linalg.norm(vector) * np.linalg.norm(want)))
        assert cosine >= 0.9999, cosine

    # The processes are the image's: its venv's Python, its user, none of this checkout mounted.
    worker = live_ready_workers(cluster.core, cluster.namespace, GROUP)[0]
    kubectl = cluster.control_plane.kubectl
    for pod, what in ((worker, "iwg-worker"), (driver, "iwg-driver")):
        name = pod.metadata.name
        command = kubectl("exec", "-n", cluster.namespace, name, "--", "cat", "/proc/1/cmdline").stdout
        assert command.startswith("/opt/venv/bin/python") and what in command, command
        assert kubectl("exec", "-n", cluster.namespace, name, "--", "id", "-u").stdout.strip() == "65532"
        mounts = kubectl("exec", "-n", cluster.namespace, name, "--", "cat", "/proc/1/mountinfo").stdout
        assert str(REPO_ROOT) not in mounts and not re.search(r" /usr/local/bin ", mounts), mounts
        package = kubectl(
            "exec",
            "-n",
            cluster.namespace,
            name,
            "--",
            "python",
            "-c",
            "import iwg_worker; print(iwg_worker.__file__)",
        ).stdout.strip()
        assert package.startswith("/opt/venv/lib/python3.11/site-packages/iwg_worker/"), package
