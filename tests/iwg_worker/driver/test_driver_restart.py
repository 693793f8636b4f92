"""The group survives its driver: `iwg-driver` SIGKILLed under load and started again on the same addresses
(as the kubelet restarts a driver container) while the `iwg-worker` processes run on. The workers notice the
loss within the heartbeat timeout, keep their model (same processes, one model load in their logs) and serve
the new driver; requests in flight on the dead driver fail with a connection error at the client, none hangs,
and every answer is the right one."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from iwg_operator.api import wiring
from iwg_worker.executor.multiproc import launch_worker

from tests.iwg_worker.driver.conftest import STARTUP_TIMEOUT_S, Wiring, stop, wait_http, wire_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Long enough that a 2-3 s stall of a loaded CI machine does not miss three heartbeats of a live peer.
HEARTBEAT_S = 2.0
HEARTBEAT_TIMEOUT_S = HEARTBEAT_S * wiring.DEFAULT_HEARTBEAT_MISSES
# A worker notices a dead driver within the heartbeat timeout plus a heartbeat or two (it looks once per beat),
# and 3 s for a stalled process.
NOTICE_LIMIT_S = HEARTBEAT_TIMEOUT_S + 2 * HEARTBEAT_S + 3.0
TEXTS = [f"sentence {i} about {topic}" for i, topic in enumerate(["owls", "ports", "rain", "salt"] * 3)]
LOADED = "ready on"  # WorkerProc's line once its model is loaded
LOST = "driver lost: no ping"
CLIENT_TIMEOUT_S = 30.0


async def embed(session: aiohttp.ClientSession, url: str, text: str) -> tuple[int, np.ndarray | None]:
    async with session.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": text}) as resp:
        body = await resp.json()
        return resp.status, np.asarray(body["data"][0]["embedding"]) if resp.status == 200 else None


async def ready(url: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session,
            session.get(f"{url}/readyz") as resp,
        ):
            return resp.status == 200
    except aiohttp.ClientError:
        return False


def test_workers_keep_their_model_and_serve_a_restarted_driver(tmp_path: Path) -> None:
    wired = wire_group(tmp_path, "phoenix", replicas=2, bound=2, heartbeat_s=HEARTBEAT_S)
    driver, driver_log = wired.start_driver()
    worker_logs = [tmp_path / f"worker-{r}.log" for r in (0, 1)]
    workers = [launch_worker(wired.worker_envs[r], worker_logs[r]) for r in (0, 1)]
    try:
        wait_http(f"{wired.url}/readyz", driver, STARTUP_TIMEOUT_S, driver_log)
        asyncio.run(_restart(wired, driver, workers, worker_logs))
    finally:
        if driver.poll() is None:  # the test failed before it killed the driver
            stop(driver, timeout=15)
        for worker in workers:
            stop(worker, timeout=15)


async def _restart(
    wired: Wiring,
    first: subprocess.Popen[bytes],
    procs: list[subprocess.Popen[bytes]],
    worker_logs: list[Path],
) -> None:
    url = wired.url
    pids = [p.pid for p in procs]
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Both replicas serve before the load: a worker that joins after the kill was never pinged, and logs
        # that no driver reached it instead of the loss (a slow start of one worker did that once).
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            async with session.get(f"{url}/readyz") as resp:
                if sorted((await resp.json())["serving_replicas"]) == [0, 1]:
                    break
            assert time.monotonic() < deadline, "both replicas serving"
            await asyncio.sleep(0.2)
        reference = {}
        for text in TEXTS:
            status, vector = await embed(session, url, text)
            assert status == 200 and vector is not None
            reference[text] = vector
        # The driver decoded the workers' tensors without torch: importing it took seconds with the GIL held,
        # a new driver's first answers and pings waited for it.
        libraries = Path(f"/proc/{first.pid}/maps").read_text()
        assert "libtorch" not in libraries, "the driver imported torch to read its workers' replies"

        answers: list[tuple[str, np.ndarray]] = []
        connection_errors: list[str] = []
        other: list[str] = []
        # The new driver answers HTTP before its workers rejoin: 503 (Retry-After) until then, as its /readyz
        # says; a cluster's Service sends it nothing before it is Ready. Kept: when each such request was sent.
        not_ready: list[float] = []
        stop_load = asyncio.Event()

        async def client(index: int) -> None:
            n = 0
            while not stop_load.is_set():
                text = TEXTS[(index * 5 + n) % len(TEXTS)]
                n += 1
                started = time.monotonic()
                try:
                    status, vector = await embed(session, url, text)
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
                    connection_errors.append(f"{type(error).__name__}: {error}")
                    await asyncio.sleep(0.05)
                    continue
                except Exception as error:  # a timeout would be a hung request
                    other.append(f"{type(error).__name__}: {error}")
                    await asyncio.sleep(0.05)  # an error raised at once must not keep the loop from the test
                    continue
                if status == 200 and vector is not None:
                    answers.append((text, vector))
                elif status == 503:
                    not_ready.append(started)
                else:
                    other.append(f"HTTP {status}")

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        try:
            deadline = time.monotonic() + 30
            while not answers:
                assert time.monotonic() < deadline, f"no request answered in 30 s of load: {other[:5]}"
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # the load under way

            first.send_signal(signal.SIGKILL)
            first.wait()
            killed = time.monotonic()
            # Both workers notice within the heartbeat timeout (plus a heartbeat or two: they look once per beat).
            while not all(LOST in log.read_text(errors="replace") for log in worker_logs):
                assert time.monotonic() - killed < NOTICE_LIMIT_S, [
                    log.read_text(errors="replace")[-1500:] for log in worker_logs
                ]
                await asyncio.sleep(0.05)
            noticed_s = time.monotonic() - killed

            second, second_log = wired.start_driver()
            try:
                restarted = time.monotonic()
                while not await ready(url):
                    assert second.poll() is None, second_log.read_text()[-3000:]
                    assert time.monotonic() - restarted < 120, second_log.read_text()[-3000:]
                    await asyncio.sleep(0.1)
                serving_at = time.monotonic()
                rejoined_s = serving_at - restarted
                answered_at_restart = len(answers)
                await asyncio.sleep(3.0)  # load on the new driver
                deadline = time.monotonic() + 30
                while len(answers) <= answered_at_restart:
                    assert time.monotonic() < deadline, (
                        f"the new driver answered nothing in 30 s: {other[:5]}"
                    )
                    await asyncio.sleep(0.1)
                stop_load.set()
                await asyncio.wait_for(asyncio.gather(*clients), CLIENT_TIMEOUT_S + 10)

                print(
                    f"workers noticed the loss after {noticed_s:.2f} s; new driver serving {rejoined_s:.2f} s after "
                    f"its start; {len(answers)} answered, {len(connection_errors)} connection errors, "
                    f"{len(not_ready)} 503 before the new driver was ready"
                )
                assert other == [], other[:5]
                assert [t for t in not_ready if t > serving_at] == []
                assert connection_errors, "the load never met the dead driver"
                assert len(answers) > answered_at_restart, "the new driver answered nothing"
                for text, vector in answers:
                    assert float(np.dot(reference[text], vector)) >= 0.9999, text
                # The same worker processes, each with one model load: they were not restarted.
                assert [p.pid for p in procs] == pids and all(p.poll() is None for p in procs)
                for log in worker_logs:
                    text = log.read_text(errors="replace")
                    assert text.count(LOADED) == 1, text[-3000:]
                    assert "driver reached this worker again" in text, text[-3000:]
            finally:
                assert stop(second) == 0, second_log.read_text()[-3000:]
        finally:  # whatever failed: no client keeps sending after the test
            stop_load.set()
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)


def test_every_worker_serves_every_driver_and_one_driver_dying_leaves_the_other_serving(
    tmp_path: Path,
) -> None:
    wired = wire_group(tmp_path, "twins", replicas=1, bound=1, heartbeat_s=HEARTBEAT_S, drivers=2)
    drivers = [wired.start_driver(i) for i in (0, 1)]
    worker_log = tmp_path / "worker-0.log"
    worker = launch_worker(wired.worker_envs[0], worker_log)
    try:
        for (proc, log), url in zip(drivers, wired.urls, strict=True):
            wait_http(f"{url}/readyz", proc, STARTUP_TIMEOUT_S, log)
        asyncio.run(_twins(wired, drivers[0][0], worker, worker_log))
    finally:
        stop(worker, timeout=15)
        for proc, log in drivers:
            if proc.poll() is None:
                assert stop(proc) == 0, log.read_text()[-3000:]


async def _twins(
    wired: Wiring, first: subprocess.Popen[bytes], worker: subprocess.Popen[bytes], worker_log: Path
) -> None:
    pid = worker.pid
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # The one worker answers both drivers, the same vectors for the same texts, concurrently.
        both = await asyncio.gather(*(embed(session, url, text) for text in TEXTS for url in wired.urls))
        assert all(status == 200 for status, _ in both)
        reference = {text: both[2 * i][1] for i, text in enumerate(TEXTS)}
        for i, text in enumerate(TEXTS):
            assert float(np.dot(reference[text], both[2 * i + 1][1])) >= 0.9999, text

        answers: list[tuple[str, np.ndarray]] = []
        failures: list[str] = []
        stop_load = asyncio.Event()

        async def client(index: int) -> None:
            n = 0
            while not stop_load.is_set():
                text = TEXTS[(index * 5 + n) % len(TEXTS)]
                n += 1
                try:
                    status, vector = await embed(session, wired.urls[1], text)
                except Exception as error:
                    failures.append(f"{type(error).__name__}: {error}")
                    continue
                if status == 200 and vector is not None:
                    answers.append((text, vector))
                else:
                    failures.append(f"HTTP {status}")

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        deadline = time.monotonic() + 30
        while not answers:
            assert time.monotonic() < deadline, f"no request answered in 30 s of load: {failures[:5]}"
            await asyncio.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait()
        killed = time.monotonic()
        while LOST not in worker_log.read_text(errors="replace"):
            assert time.monotonic() - killed < NOTICE_LIMIT_S
            await asyncio.sleep(0.05)
        answered_at_loss = len(answers)
        await asyncio.sleep(2.0)  # more load on the second driver
        deadline = time.monotonic() + 30
        while len(answers) <= answered_at_loss:
            assert time.monotonic() < deadline, f"the second driver answered nothing in 30 s: {failures[:5]}"
            await asyncio.sleep(0.1)
        stop_load.set()
        await asyncio.wait_for(asyncio.gather(*clients), CLIENT_TIMEOUT_S + 10)

    print(f"second driver: {len(answers)} answered, {len(failures)} failed, around the first one's SIGKILL")
    assert failures == [], failures[:5]
    assert len(answers) > answered_at_loss > 0
    for text, vector in answers:
        assert float(np.dot(reference[text], vector)) >= 0.9999, text
    assert worker.pid == pid and worker.poll() is None
    assert worker_log.read_text(errors="replace").count(LOADED) == 1


async def running(session: aiohttp.ClientSession, url: str) -> float:
    """The driver's count of generation requests running on its replicas' engines."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("iwg_requests_running ")
    )


def test_a_lost_drivers_generation_requests_are_cancelled_on_the_worker(tmp_path: Path) -> None:
    wired = wire_group(
        tmp_path, "pair", replicas=1, bound=1, heartbeat_s=HEARTBEAT_S, drivers=2, generate=True
    )
    drivers = [wired.start_driver(i) for i in (0, 1)]
    worker_log = tmp_path / "worker-0.log"
    worker = launch_worker(wired.worker_envs[0], worker_log)
    try:
        for (proc, log), url in zip(drivers, wired.urls, strict=True):
            wait_http(f"{url}/readyz", proc, STARTUP_TIMEOUT_S, log)
        asyncio.run(_orphans(wired, drivers[0][0], worker_log))
    finally:
        stop(worker, timeout=15)
        for proc, log in drivers:
            if proc.poll() is None:
                assert stop(proc) == 0, log.read_text()[-3000:]


async def _orphans(wired: Wiring, first: subprocess.Popen[bytes], worker_log: Path) -> None:
    body = {"model": "smollm2", "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # A long stream through the first driver; the second sees it running on the worker's engine.
        resp = await session.post(f"{wired.urls[0]}/v1/completions", json={**body, "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        deadline = time.monotonic() + 30
        while await running(session, wired.urls[1]) < 1:
            assert time.monotonic() < deadline, "the second driver never saw the stream running"
            await asyncio.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # nobody is left to read or cancel that stream
        first.wait()
        killed = time.monotonic()
        resp.close()
        # The worker cancels the lost driver's request when it notices the loss, not 2000 tokens later.
        while await running(session, wired.urls[1]) > 0:
            assert time.monotonic() - killed < HEARTBEAT_TIMEOUT_S + 10, "the orphaned stream still runs"
            await asyncio.sleep(0.2)
        assert "cancelling 1 generation requests of the lost driver" in worker_log.read_text(errors="replace")
        # The second driver's own streams are its own, whole.
        async with session.post(f"{wired.urls[1]}/v1/completions", json={**body, "max_tokens": 5}) as answer:
            payload = await answer.json()
            assert answer.status == 200 and payload["usage"]["completion_tokens"] == 5, payload
