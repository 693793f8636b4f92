"""`iwg serve` of a group at zero replicas (issue 25): the driver alone at first, one replica's workers started
by the first request (held meanwhile, answered correctly), stopped again after scaleToZeroAfterSeconds. A real
`iwg serve` process with MiniLM."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
from openai import OpenAI

from tests.iwg_worker.driver.conftest import (
    ADMIN_TOKEN,
    ROOT,
    STARTUP_TIMEOUT_S,
    free_port,
    minilm_path,
    stop,
    subprocess_env,
    wait_http,
)
from tests.iwg_worker.driver.test_driver_serve import MODEL, iwg_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

IDLE_S = 5  # long enough that a loaded machine still finds the replica right after the answer
SENTENCE = "Kubernetes schedules pods onto nodes with free GPUs."


def at_zero(tmp_path: Path, autoscaling: str) -> Path:
    manifest = (ROOT / "examples" / "minilm.yaml").read_text()
    manifest = manifest.replace("replicas: 2", "replicas: 0")
    manifest = manifest.replace(
        "autoscaling: {enabled: false, minReplicas: 1, maxReplicas: 4, metric: queueDepth, target: 4}",
        f"autoscaling: {autoscaling}",
    )
    path = tmp_path / "minilm-zero.yaml"
    path.write_text(manifest)
    return path


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {n: float(v) for n, _, v in (line.rpartition(" ") for line in lines if line and line[0] != "#")}


def workers(process: subprocess.Popen[bytes]) -> list[psutil.Process]:
    return psutil.Process(process.pid).children(recursive=True)


def test_a_group_served_at_zero_starts_a_replica_on_the_first_request_and_stops_it_when_idle(
    tmp_path: Path,
) -> None:
    from sentence_transformers import SentenceTransformer

    manifest = at_zero(
        tmp_path,
        f"{{enabled: true, minReplicas: 0, maxReplicas: 1, metric: queueDepth, target: 4, "
        f"scaleToZeroAfterSeconds: {IDLE_S}}}",
    )
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    port = free_port()
    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "iwg_worker.cli", "serve", str(manifest)),
                *("--port", str(port), "--admin-token-file", str(token)),
            ],
            cwd=ROOT,
            env={**subprocess_env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"{url}/readyz", process, STARTUP_TIMEOUT_S, log)  # ready: it holds requests
        assert workers(process) == [], "a worker runs before any request"
        assert metrics(url)["iwg_serving_replicas"] == 0
        reference = SentenceTransformer(minilm_path(), device="cpu").encode([SENTENCE])[0]
        api = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        sent = time.monotonic()
        got = np.asarray(api.embeddings.create(model=MODEL, input=SENTENCE).data[0].embedding)
        answered = time.monotonic() - sent
        # Before anything slower: the idle window starts with the answer.
        assert workers(process), "no worker serves the answered request"
        cosine = float(got @ reference / (np.linalg.norm(got) * np.linalg.norm(reference)))
        assert cosine >= 0.9999, cosine
        seen = metrics(url)
        assert seen["iwg_activation_seconds_count"] == 1
        assert 0 < seen["iwg_last_activation_seconds"] <= answered
        # The cold start in its parts, from the worker's hello: a process started for this request (pod_start:
        # the replica's processes spawned), its imports, MiniLM's load; together the whole.
        parts = {
            phase: seen[f'iwg_last_activation_phase_seconds{{phase="{phase}"}}']
            for phase in ("pod_start", "worker_start", "model_load", "ready", "first_answer")
        }
        assert parts["pod_start"] > 0 and parts["worker_start"] > 0 and parts["model_load"] > 0, parts
        assert sum(parts.values()) == pytest.approx(seen["iwg_last_activation_seconds"], abs=0.05), parts
        # Idle for scaleToZeroAfterSeconds: the replica is drained and its workers stop.
        deadline = time.monotonic() + IDLE_S + 30
        while workers(process) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert workers(process) == [], "the replica did not stop after the idle window"
        assert metrics(url)["iwg_serving_replicas"] == 0
        split = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in parts.items())
        print(f"first answer after {answered:.1f} s (cold start: {split}); back to zero")
    finally:
        code = stop(process)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "starting one" in text and "draining and stopping replica 0" in text, text[-3000:]


def test_iwg_serve_refuses_zero_replicas_unless_the_group_scales_from_zero(tmp_path: Path) -> None:
    result = iwg_serve(at_zero(tmp_path, "{enabled: false, minReplicas: 0, maxReplicas: 1}"))
    assert result.returncode == 2, result.stderr
    assert "0 with spec.autoscaling enabled and minReplicas 0" in result.stderr
