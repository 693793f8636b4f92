"""RayExecutor on a local Ray (2 CPUs): same output as UniProc, clear errors, no hang when an actor dies.

The module starts one local Ray. Tests run in file order: the MiniLM tests (an executor here, then
`iwg serve --executor ray` joining this Ray) each start and stop their own rank; then one replica of two
RPC-only ranks (filling the 2 CPUs) serves the rest, and the last of those tests kills one of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: the RayExecutor needs the 'ray' extra")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from iwg_worker import distributed  # noqa: E402
from iwg_worker.executor.base import (  # noqa: E402
    MembershipEvent,
    ReplicaLostError,
    ReplicaUnavailableError,
    RPCError,
    RPCTimeoutError,
)
from iwg_worker.executor.ray import RayExecutor  # noqa: E402
from iwg_worker.executor.uniproc import UniProcExecutor  # noqa: E402
from iwg_worker.worker_base import WorkerConfig  # noqa: E402

from tests.iwg_worker.driver.conftest import ROOT, free_port, stop, wait_http  # noqa: E402
from tests.iwg_worker.driver.conftest import subprocess_env as serve_env  # noqa: E402

SENTENCES = [
    "The operator keeps every worker healthy.",
    "Ray places a replica's ranks with a placement group.",
    "short",
]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    # Ray's processes inherit this process's environment: conftest put this checkout first on PYTHONPATH
    # and set HF_HUB_OFFLINE, so the actors run the code under test, offline.
    attempts = 4
    for attempt in range(1, attempts + 1):
        # Ray gives its raylet a fixed 30 s to register with the GCS; a saturated machine can miss that, twice
        # in a row in the whole suite (four lanes and two real-node clusters on two cores, load 15).
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                object_store_memory=150 * 1024 * 1024,
                log_to_driver=False,
            )
            break
        except Exception:
            ray.shutdown()
            if attempt == attempts:
                raise
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def rpc_pair() -> Iterator[RayExecutor]:
    """One replica of two RPC-only ranks (they still join a gloo process group)."""
    executor = RayExecutor(
        WorkerConfig(task="none", device="cpu", world_size=2),
        worker_extension_cls="tests.iwg_worker.extensions.ProbeExtension",
        startup_timeout_s=120,
    )
    try:
        yield executor
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def uniproc_embeddings(minilm_path: str) -> torch.Tensor:
    uniproc = UniProcExecutor(WorkerConfig(task="embed", model_path=minilm_path, device="cpu"))
    try:
        embeddings: torch.Tensor = uniproc.execute_model({"inputs": SENTENCES})["embeddings"]
        return embeddings
    finally:
        uniproc.shutdown()


def test_same_batch_same_output_as_uniproc(minilm_path: str, uniproc_embeddings: torch.Tensor) -> None:
    batch = {"inputs": SENTENCES}
    expected = uniproc_embeddings

    executor = RayExecutor(
        WorkerConfig(task="embed", model_path=minilm_path, device="cpu"), startup_timeout_s=180
    )
    try:
        got = executor.execute_model(batch)["embeddings"]
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (len(SENTENCES), 384)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert executor.ranks[(0, 0)].pid != os.getpid()
        [health] = executor.check_health()
        assert health["steps"] == 1 and health["model_loaded"] is True
    finally:
        executor.shutdown()


def test_iwg_serve_with_the_ray_executor(tmp_path: Path, uniproc_embeddings: torch.Tensor) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "iwg_worker.cli", "serve", str(ROOT / "examples" / "minilm.yaml"),
        "--executor", "ray", "--ray-address", ray.get_runtime_context().gcs_address,
        "--replicas", "1", "--port", str(port),
    ]  # fmt: skip
    env = {**serve_env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, 300, log)
        body = json.dumps({"model": "all-MiniLM-L6-v2", "input": SENTENCES, "encoding_format": "float"})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/embeddings", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            data = json.load(response)["data"]
        got = torch.tensor([d["embedding"] for d in data])
        torch.testing.assert_close(got, uniproc_embeddings, atol=1e-5, rtol=1e-5)
    finally:
        code = stop(proc)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "RayExecutor: 1 replica(s) x 1 rank(s)" in text, text[-3000:]


def test_a_worker_class_that_does_not_resolve_is_named_and_nothing_is_left_behind() -> None:
    before = ray.available_resources().get("CPU", 0.0)
    expected = (
        r"^'init_worker' failed on replica 0 rank 0: ValueError: worker_cls 'no_such_module\.Worker' does"
    )
    with pytest.raises(RPCError, match=expected) as info:
        RayExecutor(
            WorkerConfig(task="none", device="cpu"), worker_cls="no_such_module.Worker", startup_timeout_s=120
        )
    assert "resolve_qualname" in info.value.remote_traceback
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) < before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == before, "the placement group and actor were released"


def test_replica_ranks_share_a_placement_group_and_a_process_group(rpc_pair: RayExecutor) -> None:
    ranks = [rpc_pair.ranks[(0, 0)], rpc_pair.ranks[(0, 1)]]
    assert ranks[0].placement_group and ranks[0].placement_group == ranks[1].placement_group
    assert ranks[0].pid != ranks[1].pid
    # What the ranks report, not how fast: a saturated machine kept a rank past the default 10 s once.
    assert [h["distributed"] for h in rpc_pair.check_health(timeout=60)] == ["gloo", "gloo"]
    # The two actors really form one torch.distributed group: the sharded MLP equals the unsharded one.
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    sharded = rpc_pair.collective_rpc("tp_reference", (x, 11, 16), unique_reply_rank=0)
    torch.testing.assert_close(sharded, distributed.unsharded_reference(x, 11, 16))


def test_tensors_and_arrays_keep_their_kind_dtype_and_values(rpc_pair: RayExecutor) -> None:
    sent = [
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        torch.zeros(0, 5, dtype=torch.int64),
        {
            "half": torch.full((2,), 0.5, dtype=torch.float16),
            "array": np.arange(6, dtype=np.int32).reshape(2, 3),
        },
        torch.arange(8, dtype=torch.float32)[::2],  # not contiguous
    ]
    back = rpc_pair.collective_rpc("echo", tuple(sent), unique_reply_rank=1)
    for got, want in (
        (back[0], sent[0]),
        (back[1], sent[1]),
        (back[2]["half"], sent[2]["half"]),
        (back[3], sent[3]),
    ):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    assert isinstance(back[2]["array"], np.ndarray) and back[2]["array"].dtype == np.int32
    np.testing.assert_array_equal(back[2]["array"], sent[2]["array"])


def test_unknown_method_timeout_and_plain_data(rpc_pair: RayExecutor) -> None:
    with pytest.raises(RPCError, match="'no_such_method'") as info:
        rpc_pair.collective_rpc("no_such_method")
    assert info.value.remote_type == "UnknownMethodError"

    assert rpc_pair.collective_rpc("echo", (1, "two", b"3")) == [[1, "two", b"3"]] * 2
    assert rpc_pair.collective_rpc("echo", ({"k": [1.5]},), unique_reply_rank=1) == [{"k": [1.5]}]

    started = time.monotonic()
    with pytest.raises(
        RPCTimeoutError, match=r"'sleep' timed out after 0.5 s: no reply from replica 0 ranks \[1\]"
    ):
        rpc_pair.collective_rpc("sleep", (8.0,), timeout=0.5, unique_reply_rank=1)
    # Failed by its own timeout (plus room for a stalled CI machine), not when the 8 s call ended.
    assert time.monotonic() - started < 4.0

    with pytest.raises(TypeError, match=r"args\[0\]\['f'\] is a function"):
        rpc_pair.collective_rpc("echo", ({"f": lambda: None},))
    # The executor still serves after all of that (the sleep finishes first: actors run calls in order).
    assert rpc_pair.collective_rpc("echo", ("after",), timeout=30) == [["after"], ["after"]]


def test_killed_actor_fails_pending_call_without_hanging(rpc_pair: RayExecutor) -> None:
    events: list[MembershipEvent] = []
    seen = threading.Event()

    def on_event(event: MembershipEvent) -> None:
        events.append(event)
        if event.kind == "lost":
            seen.set()

    rpc_pair.subscribe(on_event)
    # Rank 0 is the only one to reply and would answer after 30 s: only death detection ends this sooner.
    pending = rpc_pair.collective_rpc_future("sleep", (30.0,), unique_reply_rank=0)
    time.sleep(0.5)
    victim = rpc_pair.ranks[(0, 1)]
    started = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)

    with pytest.raises(ReplicaLostError) as info:
        pending.result(timeout=20)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "'sleep'" in message and "lost ranks [1]" in message and f"pid {victim.pid}" in message
    assert elapsed < 10, f"death noticed after {elapsed:.1f} s"

    assert seen.wait(5)
    assert [(e.kind, e.rank) for e in events] == [("left", 1), ("lost", None)]
    assert rpc_pair.serving_replicas() == frozenset()
    with pytest.raises(ReplicaUnavailableError, match=r"'echo'.*replica 0.*\[1\]"):
        rpc_pair.collective_rpc("echo", (1,))


def test_bad_options_are_refused_before_ray_is_touched() -> None:
    config = WorkerConfig(task="none")
    with pytest.raises(ValueError, match="placement_strategy"):
        RayExecutor(config, placement_strategy="TIGHT")
    with pytest.raises(ValueError, match="replicas"):
        RayExecutor(config, replicas=0)
