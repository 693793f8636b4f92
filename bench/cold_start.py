"""Issue 25's cold start: a group at zero replicas answers its first request; the time to that answer in its parts.

    python -m bench.cold_start [--groups minilm,smollm2-transformers,smollm2-vllm] [--runs 5] [--idle 2]
                               [--burst N]

Per group, one `iwg serve` at zero replicas (spec.autoscaling enabled, minReplicas 0, scaleToZeroAfterSeconds
``--idle``), then ``--runs`` activations one after another: one request (an embedding, or a 16-token greedy chat
completion) sent with no replica running, its time to answer measured by the client, and the driver's split of
that activation read from its metrics (`iwg_last_activation_phase_seconds{phase}`: pod_start, worker_start,
model_load, ready, first_answer; docs/driver.md); then the group is left idle until its workers are gone. Printed:
each run, then per group the median (p50) of the whole and of each part. The baseline in the same run is the
same group started with one replica from the start (`iwg serve` process start to ready): what a cold start
costs beyond that is the activation's own (the autoscaler's reaction, the held request's way).

``--burst N``: each activation is N requests sent at once (as the scale-to-zero e2e sends 32 chat requests; the
even-numbered ones streamed), the client's figure the first of them answered (its first token when streamed,
its whole reply otherwise), and the time until the last one's whole reply is printed beside it. The issue's
bound, "first answer within cold start + 5 s", is the ``first_answer`` part (the replica serving to the first
answer): what the first engine step over the whole burst adds to the cold start.

The peer, for the vLLM group: `vllm serve` on the same directory, dtype, eager, started as a scale-from-zero
platform (Knative in KServe) starts it for a first request: its start to ready (`/health`), then the same first
chat request; its sum is what a client waits there beyond the pod's scheduling. Both servers' second start is
printed (the first warms the page cache).

SmolLM2 loads from its converted directory; vLLM runs eager. Figures need a quiet machine.

``--fresh-vllm-cache``: every `iwg serve` start gets an empty ``VLLM_CACHE_ROOT``, as a pod does (its ``$HOME`` is
a new emptyDir), where vLLM finds no model information, compile cache or anything else it kept from an earlier
start; the baseline then is such a start, and so is each group's first activation (later ones find what it
wrote: they are the same process's workers).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests.iwg_worker.driver.conftest import ROOT, free_port, minilm_path, stop, subprocess_env, wait_http
from tests.models import smollm2_manifest

PHASES = ("pod_start", "worker_start", "model_load", "ready", "first_answer")
GROUPS = ("minilm", "smollm2-transformers", "smollm2-vllm")


def manifest(group: str, replicas: int, idle_s: float) -> dict[str, Any]:
    if group == "minilm":
        out: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
        out["spec"]["model"]["path"] = minilm_path()
    else:
        out = smollm2_manifest(engine=group.removeprefix("smollm2-"))
    out["spec"]["replicas"] = replicas
    out["spec"]["autoscaling"] = {
        "enabled": True,
        "minReplicas": 0,
        "maxReplicas": 1,
        "metric": "queueDepth",
        "target": 4,
        "scaleToZeroAfterSeconds": idle_s,
    }
    return out


def start(
    group: str, replicas: int, idle_s: float, tmp: Path, fresh_vllm_cache: bool = False
) -> tuple[subprocess.Popen[bytes], str, float]:
    env = {**subprocess_env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}:{ROOT}"}
    if fresh_vllm_cache:
        env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-", dir=tmp)
    path = tmp / f"{group}-{replicas}.yaml"
    path.write_text(yaml.safe_dump(manifest(group, replicas, idle_s)))
    port = free_port()
    log = tmp / f"{group}-{replicas}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "iwg_worker.cli", "serve", str(path), "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", process, 600, log)
    return process, url, time.monotonic() - started


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {n: float(v) for n, _, v in (line.rpartition(" ") for line in lines if line and line[0] != "#")}


def ask(url: str, group: str, stream: bool = False) -> float:
    """One request; the monotonic time of its first answer (its first token when streamed)."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    if group == "minilm":
        api.embeddings.create(
            model="all-MiniLM-L6-v2", input="Kubernetes schedules pods onto nodes with free GPUs."
        )
        return time.monotonic()
    question: Any = [{"role": "user", "content": "What is the capital of France?"}]
    if not stream:
        api.chat.completions.create(model="smollm2", messages=question, max_tokens=16, temperature=0)
        return time.monotonic()
    first: float | None = None
    chunks = api.chat.completions.create(
        model="smollm2", messages=question, max_tokens=16, temperature=0, stream=True
    )
    for chunk in chunks:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
    if first is None:
        raise RuntimeError("a streamed request got no token")
    return first


def burst(url: str, group: str, count: int) -> tuple[float, float]:
    """``count`` requests at once (the even-numbered ones streamed, for generation): the seconds to the first
    answer among them and to the last whole reply."""
    sent = time.monotonic()
    if count == 1:
        done = ask(url, group)
        return done - sent, done - sent

    def one(i: int) -> tuple[float, float]:
        first = ask(url, group, stream=group != "minilm" and i % 2 == 0)
        return first, time.monotonic()

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(one, range(count)))
    return min(f for f, _ in answers) - sent, max(d for _, d in answers) - sent


def idle(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the group's workers are gone (scaled back to zero)."""
    deadline = time.monotonic() + timeout_s
    while psutil.Process(process.pid).children(recursive=True):
        if time.monotonic() > deadline:
            raise TimeoutError("the replica did not stop after the idle window")
        time.sleep(0.2)


def vllm_serve_cold(tmp: Path, fresh_vllm_cache: bool) -> tuple[float, float]:
    """`vllm serve`'s start to ready and its first answer after, SmolLM2 as the vLLM group serves it."""
    import os

    from bench.engines import start_vllm_serve
    from bench.engines import stop as stop_server

    group = manifest("smollm2-vllm", 1, 0)["spec"]["model"]
    options = argparse.Namespace(
        dtype=group["dtype"], device="cpu", enforce_eager=group["enforceEager"], startup_timeout=600.0
    )
    kept = os.environ.get("VLLM_CACHE_ROOT")
    if fresh_vllm_cache:  # server_env copies this process's environment
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-serve-cache-", dir=tmp)
    try:
        server = start_vllm_serve(options, tmp, Path(group["path"]), group["kvCache"]["blocks"])
    finally:
        os.environ.pop("VLLM_CACHE_ROOT", None)
        if kept is not None:
            os.environ["VLLM_CACHE_ROOT"] = kept
    try:
        sent = time.monotonic()
        ask(server.url, "smollm2-vllm")
        return server.startup_s, time.monotonic() - sent
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--idle", type=float, default=2.0, help="scaleToZeroAfterSeconds")
    parser.add_argument("--fresh-vllm-cache", action="store_true", help="an empty VLLM_CACHE_ROOT per start")
    parser.add_argument("--burst", type=int, default=1, help="requests sent at once per activation")
    args = parser.parse_args()
    fresh = ", an empty VLLM_CACHE_ROOT per start" if args.fresh_vllm_cache else ""
    each = f", {args.burst} requests at once per activation" if args.burst > 1 else ""
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {psutil.getloadavg()[0]:.1f}{fresh}{each}"
    )
    print("| group | run | first answer s (client) | last reply s | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|" + "---|" * len(PHASES), flush=True)
    summary = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        for group in args.groups.split(","):
            for _ in range(2):  # the baseline, a replica from the start: the second start (caches warm)
                process, url, baseline = start(group, 1, args.idle, tmp, args.fresh_vllm_cache)
                stop(process)
            process, url, _ = start(group, 0, args.idle, tmp, args.fresh_vllm_cache)
            totals: list[float] = []
            lasts: list[float] = []
            parts: dict[str, list[float]] = {p: [] for p in PHASES}
            try:
                for run in range(args.runs):
                    idle(process, args.idle + 120)
                    first, last = burst(url, group, args.burst)
                    totals.append(first)
                    lasts.append(last)
                    seen = metrics(url)
                    row = [seen.get(f'iwg_last_activation_phase_seconds{{phase="{p}"}}', 0.0) for p in PHASES]
                    for phase, seconds in zip(PHASES, row, strict=True):
                        parts[phase].append(seconds)
                    cells = " | ".join(f"{s:.2f}" for s in row)
                    print(f"| {group} | {run + 1} | {first:.2f} | {last:.2f} | {cells} |", flush=True)
            finally:
                stop(process)
            medians = " | ".join(f"{statistics.median(parts[p]):.2f}" for p in PHASES)
            summary.append(
                f"| {group} | {statistics.median(totals):.2f} | {statistics.median(lasts):.2f} | {medians} "
                f"| {baseline:.2f} |"
            )
            if group == "smollm2-vllm":
                for _ in range(2):
                    ready, answer = vllm_serve_cold(tmp, args.fresh_vllm_cache)
                peer = (
                    f"| vllm serve (peer, one request) | {ready + answer:.2f} | - |"
                    + " - |" * len(PHASES)
                    + f" {ready:.2f} |"
                )
                summary.append(peer)
    print(
        "\n| group | p50 first answer s | p50 last reply s | "
        + " | ".join(f"p50 {p}" for p in PHASES)
        + " | baseline: start to ready |"
    )
    print("|---|---|---|" + "---|" * len(PHASES) + "---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
