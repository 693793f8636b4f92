"""Executors against real worker processes, real ZMQ (ipc and tcp+CURVE), real torch and MiniLM weights.

Three groups are started once for the module: a Multiproc group of one replica of two ranks over ipc, joined by
torch.distributed/gloo, that serves RPC only (two ranks serve a model only sharded, and MiniLM's architecture
has no tensor-parallel plan: tests/iwg_worker/engine/test_tensor_parallel.py shards SmolLM2 three ways); a
one-rank Multiproc group serving MiniLM; and a Cluster group (two one-rank replicas over tcp with CURVE,
launched as ``iwg-worker`` processes from the wiring-contract environment, as pods would be). The test that
kills a worker uses the cluster's replica 1; replica 0 keeps serving throughout.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iwg_worker import protocol
from iwg_worker.distributed import reference_weights, unsharded_reference
from iwg_worker.executor import MembershipEvent, ReplicaLostError, RPCError, RPCTimeoutError
from iwg_worker.executor.cluster import ClusterExecutor
from iwg_worker.executor.multiproc import MultiprocExecutor, launch_worker, worker_env
from iwg_worker.executor.uniproc import UniProcExecutor
from iwg_worker.security import CurveKeys, make_client
from iwg_worker.worker_base import WorkerConfig

from .conftest import SENTENCES

EXT = "tests.iwg_worker.extensions.ProbeExtension"
# The cluster's heartbeat: its timeout (3 heartbeats, 6 s) outlasts a 2-3 s stall of a loaded CI machine, and a
# killed worker is still detected in seconds, well before its 30 s call would end.
HEARTBEAT_S = 2.0


@pytest.fixture(scope="module")
def multiproc(cluster_launched: Cluster) -> Iterator[MultiprocExecutor]:
    # Depends on cluster_launched only so that the groups start at once (startup is most of the time).
    executor = MultiprocExecutor(
        WorkerConfig(task="none", device="cpu", group="mp"),
        replicas=1,
        world_size=2,
        worker_extension_cls=EXT,
        # The default heartbeat (a 3 s timeout): no test here times this group's failure detection, and at
        # 0.5 s (1.5 s) a loaded CI machine once had both ranks counted gone when the SIGINT test called them.
        startup_timeout_s=600,
    )
    yield executor
    executor.shutdown()


@pytest.fixture(scope="module")
def multiproc_embed(minilm_path: str, cluster_launched: Cluster) -> Iterator[MultiprocExecutor]:
    executor = MultiprocExecutor(
        WorkerConfig(task="embed", model_path=minilm_path, device="cpu", group="mpe"),
        worker_extension_cls=EXT,
        startup_timeout_s=600,  # the default heartbeat: no test here times this group's failure detection
    )
    yield executor
    executor.shutdown()


@dataclass
class Cluster:
    executor: ClusterExecutor
    keys: CurveKeys  # the driver's: its keypair and the workers' public key
    worker_keys: CurveKeys  # the workers': their keypair and the driver's public key
    curve_dir: Path  # the workers' keys, as their pods mount them
    processes: dict[int, subprocess.Popen[bytes]]
    logs: dict[int, Path]
    events: list[MembershipEvent]
    callback_threads: set[str]


@pytest.fixture(scope="module")
def cluster_launched(minilm_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    # Distinct keypairs, as the operator's Secret gives them: the driver's and the workers'.
    keys, worker_keys = CurveKeys.generate_pair()
    curve_dir = worker_keys.save(root / "curve")
    executor = ClusterExecutor(
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        replicas=2,
        world_size=1,
        keys=keys,
        group="g",
        heartbeat_interval_s=HEARTBEAT_S,
    )
    events: list[MembershipEvent] = []
    callback_threads: set[str] = set()

    def record(event: MembershipEvent) -> None:
        events.append(event)
        callback_threads.add(threading.current_thread().name)

    executor.subscribe(record)
    processes, logs = {}, {}
    for replica in range(2):
        # Replica 0 serves MiniLM; replica 1 (killed by a test) serves RPC only, to start faster.
        task = "embed" if replica == 0 else "none"
        config = WorkerConfig(task=task, model_path=minilm_path, device="cpu", group="g", replica=replica)
        env = worker_env(
            config,
            executor.rpc_endpoint,
            executor.response_endpoint,
            curve_dir=str(curve_dir),
            worker_extension_cls=EXT,
            heartbeat_interval_s=HEARTBEAT_S,
        )
        logs[replica] = root / f"worker-{replica}.log"
        processes[replica] = launch_worker(env, logs[replica])
    try:
        yield Cluster(executor, keys, worker_keys, curve_dir, processes, logs, events, callback_threads)
    finally:
        for proc in processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in processes.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        executor.shutdown()


@pytest.fixture(scope="module")
def cluster(cluster_launched: Cluster) -> Cluster:
    cluster_launched.executor.wait_until_serving(timeout=600)
    return cluster_launched


# -- the same batch, three ways --------------------------------------------------------------------------


def test_same_batch_same_output_through_uniproc_multiproc_and_cluster(
    minilm_path: str, multiproc_embed: MultiprocExecutor, cluster: Cluster
) -> None:
    batch = {"inputs": SENTENCES}
    uniproc = UniProcExecutor(WorkerConfig(task="embed", model_path=minilm_path, device="cpu"))
    try:
        local = uniproc.execute_model(batch)["embeddings"]
    finally:
        uniproc.shutdown()
    multiproc_embed.wait_until_serving(timeout=120)  # loading MiniLM here may starve its heartbeats a while
    through_multiproc = multiproc_embed.execute_model(batch)["embeddings"]
    through_cluster = cluster.executor.execute_model(batch, replica=0)["embeddings"]
    assert local.shape == (len(SENTENCES), 384)
    assert torch.equal(local, through_multiproc)
    assert torch.equal(local, through_cluster)


def test_tensor_parallel_reference_equals_unsharded(multiproc: MultiprocExecutor) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    per_rank = multiproc.collective_rpc("tp_reference", (x,), {"seed": 5, "hidden": 16}, timeout=60)
    expected = unsharded_reference(x, seed=5, hidden=16)
    assert len(per_rank) == 2
    for result in per_rank:
        assert torch.allclose(result, expected, rtol=1e-12, atol=1e-12)
    # Each half alone differs from the whole, and the two halves make it up: each rank held a shard, and the
    # all-reduce did the work.
    halves = multiproc.collective_rpc(
        "tp_reference", (x,), {"seed": 5, "hidden": 16, "reduce": False}, timeout=60
    )
    for half in halves:
        assert (half - expected).abs().max() > 1e-3
    bias = reference_weights(5, x.shape[-1], 16)[3]
    assert torch.allclose(halves[0] + halves[1] - bias, expected, rtol=1e-12, atol=1e-12)
    assert [r["distributed"] for r in multiproc.check_health()] == ["gloo", "gloo"]


# -- errors ------------------------------------------------------------------------------------------------


def test_exception_in_execute_model_carries_the_worker_traceback_and_next_call_succeeds(
    multiproc_embed: MultiprocExecutor,
) -> None:
    # The fixture's rank may be counted gone for a moment by a stall of this loaded machine (a late heartbeat:
    # it is back at its next one); this test is about the error's traceback, not about that.
    multiproc_embed.wait_until_serving(timeout=120)
    with pytest.raises(RPCError) as info:
        multiproc_embed.execute_model({"inputs": 5}, timeout=30)
    error = info.value
    assert error.method == "execute_model" and error.remote_type == "TypeError"
    assert "'inputs'" in error.remote_message
    assert "Traceback" in error.remote_traceback and "embed.py" in error.remote_traceback
    assert "worker traceback" in str(error)
    assert multiproc_embed.execute_model({"inputs": ["still serving"]}, timeout=30)["embeddings"].shape == (
        1,
        384,
    )


def test_unknown_method_error_names_it(multiproc: MultiprocExecutor) -> None:
    with pytest.raises(RPCError, match="unknown method 'launch_missiles'"):
        multiproc.collective_rpc("launch_missiles", timeout=30)


def test_timeout_names_the_method_and_the_silent_ranks(multiproc: MultiprocExecutor) -> None:
    started = time.monotonic()
    with pytest.raises(RPCTimeoutError) as info:
        multiproc.collective_rpc("sleep", (8.0,), timeout=0.3)
    # Failed by its own timeout (plus room for a stalled CI machine), not when the 8 s call ended.
    assert time.monotonic() - started < 4.0
    assert info.value.method == "sleep" and info.value.missing == [(0, 0), (0, 1)]
    assert "'sleep' timed out" in str(info.value) and "ranks [0, 1]" in str(info.value)
    # The ranks take it once their sleep ends.
    assert multiproc.collective_rpc("echo", ("after",), timeout=60) == [["after"], ["after"]]


def test_worker_extension_from_env_and_unique_reply_rank(multiproc: MultiprocExecutor) -> None:
    assert multiproc.collective_rpc("env_value", ("IWG_RANK",), timeout=30) == ["0", "1"]
    assert multiproc.collective_rpc("env_value", ("IWG_RANK",), timeout=30, unique_reply_rank=1) == "1"


# -- cluster membership, concurrency, security ----------------------------------------------------------


def test_cluster_membership_and_concurrent_per_replica_calls(cluster: Cluster) -> None:
    executor = cluster.executor
    assert executor.serving_replicas() == {0, 1}
    assert sorted((m.replica, m.rank) for m in executor.members()) == [(0, 0), (1, 0)]
    assert {e.replica for e in cluster.events if e.kind == "serving"} >= {0, 1}

    async def both() -> list[object]:
        # Replica 1 sleeps; replica 0 answers meanwhile: per-replica calls do not wait for each other.
        slow = asyncio.ensure_future(executor.collective_rpc_async("sleep", (10.0,), replica=1, timeout=60))
        fast = await executor.collective_rpc_async("echo", (b"x",), replica=0, timeout=30)
        slow_done_when_fast_returned = slow.done()
        return [fast, slow_done_when_fast_returned, await slow]

    fast, slow_done_when_fast_returned, slow = asyncio.run(both())
    assert fast == [[b"x"]] and slow == [10.0]
    assert slow_done_when_fast_returned is False


def test_peer_without_the_workers_key_is_refused_by_the_driver(cluster: Cluster) -> None:
    """The driver admits the workers' key only: another key, the driver's own keypair (with one keypair for
    every process, what the driver would have admitted) and no CURVE at all are refused."""
    executor = cluster.executor
    assert executor._zap is not None
    refused_before = executor._zap.refused
    members_before = {(m.replica, m.rank): m.routing_id for m in executor.members()}
    context = zmq.Context()
    sockets = []
    try:
        for keys in (CurveKeys.generate(), cluster.keys, None):  # another key; the driver's; no CURVE
            dealer = context.socket(zmq.DEALER)
            push = context.socket(zmq.PUSH)
            dealer.routing_id = b"rogue"
            for sock, endpoint in ((dealer, executor.rpc_endpoint), (push, executor.response_endpoint)):
                sock.linger = 0
                if keys is not None:
                    sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
                    sock.curve_serverkey = cluster.keys.public
                sock.connect(endpoint)
                sockets.append(sock)
            hello = protocol.Hello("hello", "g", 0, 0, 1, "rogue-pod", b"rogue", {})
            push.send_multipart(protocol.encode_hello(hello), flags=zmq.NOBLOCK)
            dealer.send_multipart([b"anything"], flags=zmq.NOBLOCK)
        deadline = time.monotonic() + 30
        while executor._zap.refused < refused_before + 4:  # two sockets each for the two CURVE keys
            assert time.monotonic() < deadline, f"{executor._zap.refused - refused_before} refused in 30 s"
            time.sleep(0.1)
        time.sleep(1.0)  # a peer the driver wrongly admitted would be a member (and have replied) by now
        assert {(m.replica, m.rank): m.routing_id for m in executor.members()} == members_before
        assert not any(s.poll(0) for s in sockets if s.type == zmq.DEALER)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
    assert executor.collective_rpc("echo", (1,), replica=0, timeout=30) == [[1]]


def test_a_worker_takes_no_driver_holding_the_workers_key(cluster: Cluster, minilm_path: str) -> None:
    """What a compromised worker holds (the workers' keypair and the driver's public key) cannot pose as the
    driver: a real worker linked to a driver bound with the workers' keypair never completes the CURVE
    handshake, so that driver gets no hello, no member and no call through. (With one keypair for every
    process the worker's keypair was the driver's, and this driver got the worker.)"""
    worker = cluster.worker_keys
    rogue = ClusterExecutor(
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        keys=CurveKeys(public=worker.public, secret=worker.secret, peer=worker.public),
        group="g",
        heartbeat_interval_s=HEARTBEAT_S,
    )
    log = cluster.logs[0].parent / "worker-rogue.log"
    config = WorkerConfig(task="none", model_path=minilm_path, device="cpu", group="g", replica=0)
    env = worker_env(
        config,
        rogue.rpc_endpoint,
        rogue.response_endpoint,
        curve_dir=str(cluster.curve_dir),
        heartbeat_interval_s=HEARTBEAT_S,
    )
    process = launch_worker(env, log)
    try:
        deadline = time.monotonic() + 120
        # The worker opened its link and waited three heartbeats for a ping that never came (or, were the key
        # accepted, joined the rogue driver).
        while (
            "no driver has reached this worker" not in log.read_text(errors="replace") and not rogue.members()
        ):
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        assert rogue.members() == []
        assert not rogue.serving_replicas()
    finally:
        process.terminate()
        process.wait(timeout=15)
        rogue.shutdown()


def _send_raw(executor: ClusterExecutor, replica: int, frames: list[bytes]) -> None:
    route = executor._routes[replica][0]
    with executor._send_lock:
        executor._rpc.send_multipart([route, *frames], flags=zmq.NOBLOCK)


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _in_flight(port: int) -> str | None:
    """The method a worker is running, from its /healthz."""
    import json

    healthz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).read())
    method = healthz["in_flight"]
    return None if method is None else str(method)


def _health_port(executor: ClusterExecutor, replica: int) -> int:
    (member,) = [m for m in executor.members() if m.replica == replica]
    return int(member.capabilities["health_port"])


def test_malformed_frames_to_a_worker_are_rejected_logged_and_it_keeps_serving(cluster: Cluster) -> None:
    executor = cluster.executor
    port = _health_port(executor, 0)
    rejected_before = _metric(port, "iwg_worker_rejected_messages_total")
    # One inline tensor and one framed, so mutations hit both kinds of tensor descriptor.
    big = torch.ones(protocol.INLINE_TENSOR_MAX_BYTES)
    valid = [bytes(memoryview(f)) for f in protocol.encode_call(10**9, "echo", [torch.ones(4), big])]
    sent = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.one_of(
            st.lists(st.binary(max_size=128), min_size=1, max_size=3),
            st.sampled_from(
                [[pickle.dumps({"kind": "call"})], [pickle.dumps(os.system)], [b"\x80\x04K\x01."]]
            ),
            st.tuples(st.integers(0, len(valid[0]) - 1), st.integers(0, 255)).map(
                lambda m: [valid[0][: m[0]] + bytes([m[1]]) + valid[0][m[0] + 1 :], valid[1]]
            ),
        )
    )
    def inject(frames: list[bytes]) -> None:
        _send_raw(executor, 0, frames)
        sent.append(frames)

    inject()
    _send_raw(executor, 0, [pickle.dumps({"kind": "call", "method": "echo"})])
    assert executor.collective_rpc("echo", ("alive",), replica=0, timeout=30) == [["alive"]]
    assert cluster.processes[0].poll() is None
    rejected = _metric(port, "iwg_worker_rejected_messages_total") - rejected_before
    assert rejected >= 1 and rejected <= len(sent) + 1
    # Most random inputs are junk; a few mutations stay valid calls, which the worker serves.
    assert rejected >= 0.5 * len(sent)
    assert "rejected a malformed message" in cluster.logs[0].read_text()


def test_malformed_frames_to_the_driver_are_dropped(cluster: Cluster) -> None:
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.linger = 0
    make_client(push, cluster.worker_keys)
    push.connect(cluster.executor.response_endpoint)
    try:
        for frames in ([pickle.dumps(os.system)], [os.urandom(64)], [b"\x81\xa4kind\xa5reply"]):
            push.send_multipart(frames)
        time.sleep(0.3)
        assert cluster.executor.serving_replicas() == {0, 1}
        assert cluster.executor.collective_rpc("echo", (2,), replica=0, timeout=30) == [[2]]
    finally:
        push.close()
        context.term()


def test_health_endpoints(cluster: Cluster) -> None:
    import json

    port = _health_port(cluster.executor, 0)
    healthz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).read())
    assert healthz["alive"] is True and healthz["worker"]["cpu"] is True
    assert healthz["worker"]["model_loaded"] is True and healthz["drivers"][0]["ping_age_s"] is not None
    readyz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10).read())
    assert readyz == {"ready": True, "model_loaded": True, "draining": False}
    cluster.executor.collective_rpc("echo", (1,), replica=0, timeout=30)
    assert _metric(port, "iwg_worker_requests_total") >= 1
    assert _metric(port, "iwg_worker_device_memory_free_bytes") > 0
    assert _metric(port, "iwg_worker_step_seconds_count") >= 1


# -- losing workers (runs last: the killed replica does not come back) -----------------------------------------


def test_blocking_callers_on_threads_and_futures_all_get_their_own_replies(cluster: Cluster) -> None:
    """Blocking callers receive replies themselves (for each other too) while futures wait on the I/O
    thread; a slow call on one replica holds up neither."""
    executor = cluster.executor
    slow = executor.collective_rpc_future("sleep", (15.0,), replica=1, timeout=60)
    results: dict[int, list[object]] = {}

    def caller(n: int) -> None:
        results[n] = [
            executor.collective_rpc("echo", (n, i, torch.full((3,), float(i))), replica=0, timeout=30)
            for i in range(40)
        ]

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    futures = [executor.collective_rpc_future("echo", (i,), replica=0, timeout=30) for i in range(20)]
    for thread in threads:
        thread.join(timeout=30)
    assert [f.result(timeout=30) for f in futures] == [[[i]] for i in range(20)]
    for n in range(4):
        assert len(results[n]) == 40
        for i, reply in enumerate(results[n]):
            assert isinstance(reply, list)
            [[got_n, got_i, tensor]] = reply
            assert (got_n, got_i) == (n, i) and torch.equal(tensor, torch.full((3,), float(i)))
    assert not slow.done()
    assert slow.result(timeout=60) == [15.0]


def test_killed_worker_fails_the_pending_call_within_the_heartbeat_timeout(cluster: Cluster) -> None:
    executor = cluster.executor
    errors: list[BaseException] = []

    def blocking_call() -> None:
        try:
            executor.collective_rpc("sleep", (30.0,), replica=1, timeout=60)
        except BaseException as exc:
            errors.append(exc)

    # Two calls wait on the worker: one blocked in collective_rpc (its thread receives on the socket),
    # one future (the I/O thread receives). Both must fail when it dies.
    caller = threading.Thread(target=blocking_call)
    caller.start()
    pending = executor.collective_rpc_future("sleep", (30.0,), replica=1, timeout=60)
    time.sleep(1.0)
    killed_at = time.monotonic()
    cluster.processes[1].kill()
    with pytest.raises(ReplicaLostError) as info:
        pending.result(timeout=executor.heartbeat_timeout_s + 10)
    caller.join(timeout=executor.heartbeat_timeout_s + 10)
    # The heartbeat timeout (6 s) and 3 s for a stalled CI machine: far from the 30 s the calls would take.
    assert time.monotonic() - killed_at <= executor.heartbeat_timeout_s + 3.0
    assert len(errors) == 1 and isinstance(errors[0], ReplicaLostError)
    assert info.value.method == "sleep" and info.value.replica == 1 and info.value.ranks == [0]
    assert "'sleep'" in str(info.value) and "replica 1" in str(info.value)
    assert 1 not in executor.serving_replicas()
    assert any(e.kind == "lost" and e.replica == 1 for e in cluster.events)
    # Membership callbacks ran on the I/O thread only, though blocking callers received messages too.
    assert cluster.callback_threads == {"iwg-executor-io"}
    assert executor.collective_rpc("echo", ("others serve",), replica=0, timeout=30) == [["others serve"]]


def test_sigint_finishes_the_in_flight_call_says_goodbye_and_exits_zero(
    multiproc: MultiprocExecutor,
) -> None:
    events: list[MembershipEvent] = []
    multiproc.subscribe(events.append)
    in_flight = multiproc.collective_rpc_future("sleep", (5.0,), timeout=60)
    queued = multiproc.collective_rpc_future("echo", ("never run",), timeout=60)
    # Both ranks are in the sleep (their /healthz says so) before the SIGINT; it has 5 s to come before the
    # sleep ends and the queued call would run. The ranks heartbeat until their goodbye: the rest of the sleep
    # outlasts the group's heartbeat timeout (3 s), and the driver must not count them lost meanwhile.
    ports = [int(m.capabilities["health_port"]) for m in multiproc.members()]
    assert len(ports) == 2
    deadline = time.monotonic() + 30
    while not all(_in_flight(port) == "sleep" for port in ports):
        assert time.monotonic() < deadline, "the sleep did not start on both ranks in 30 s"
        time.sleep(0.05)
    multiproc.shutdown(grace_s=30)  # SIGINT to every worker, then waits for them (a stall must not kill them)
    assert in_flight.result(timeout=0) == [5.0, 5.0]
    # The call queued behind it was never run: the goodbye's last_call says so, and it fails at once.
    error = queued.exception(timeout=0)
    assert isinstance(error, ReplicaLostError) and "goodbye" in error.reason and error.method == "echo"
    assert [wp.process.returncode for wp in multiproc.processes] == [0, 0]
    assert sorted(e.rank for e in events if e.kind == "left" and e.reason.startswith("goodbye")) == [0, 1]
    # Their heartbeats after the SIGINT said they were stopping: the replica took nothing new meanwhile.
    assert any(e.kind == "draining" for e in events), events


def raw_ranks_executor(heartbeat_interval_s: float, world_size: int = 1) -> ClusterExecutor:
    """The executor of one replica of group "g", without CURVE, on free loopback ports: for `RawRanks`."""
    return ClusterExecutor(
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        replicas=1,
        world_size=world_size,
        insecure=True,
        group="g",
        heartbeat_interval_s=heartbeat_interval_s,
    )


class RawRanks:
    """Raw ZMQ sockets standing in for worker processes of replica 0 of group "g": each process a DEALER on the
    executor's RPC endpoint (its routing id) and a PUSH on its response endpoint, which says hello, beats and
    says goodbye only when the test says."""

    def __init__(self, executor: ClusterExecutor, world_size: int = 1) -> None:
        self.executor = executor
        self.world_size = world_size
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        self.pushes: dict[bytes, zmq.Socket[bytes]] = {}

    def connect(self, routing_id: bytes) -> None:
        dealer, push = self.context.socket(zmq.DEALER), self.context.socket(zmq.PUSH)
        dealer.routing_id = routing_id
        for sock, endpoint in ((dealer, self.executor.rpc_endpoint), (push, self.executor.response_endpoint)):
            sock.linger = 0
            sock.connect(endpoint)
            self.sockets.append(sock)
        self.pushes[routing_id] = push

    def beat(self, routing_id: bytes, kind: str = "heartbeat", rank: int = 0, **capabilities: object) -> None:
        hello = protocol.Hello(kind, "g", 0, rank, self.world_size, f"pod-{rank}", routing_id, capabilities)
        self.pushes[routing_id].send_multipart(protocol.encode_hello(hello))

    def goodbye(self, routing_id: bytes, rank: int = 0) -> None:
        self.pushes[routing_id].send_multipart(protocol.encode_goodbye(0, rank, "stopping", None))

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


def test_a_draining_rank_drains_its_whole_replica_until_it_leaves() -> None:
    """A heartbeat with ``capabilities.draining`` (a worker that got SIGTERM) makes its replica draining, whichever
    rank sends it; the replica still serves (what it runs finishes) and is draining until that rank's goodbye.
    Raw sockets stand in for the two ranks of one replica."""
    # A 30 s heartbeat (90 s timeout): the raw ranks beat only when the test says, and rank 0 is silent from its
    # hello to its beat below, which a stalled CI machine must not stretch past the timeout.
    executor = raw_ranks_executor(30, world_size=2)
    events: list[MembershipEvent] = []
    executor.subscribe(events.append)
    ranks = RawRanks(executor, world_size=2)
    try:
        for rank in (0, 1):
            ranks.connect(f"rank-{rank}".encode())

        def beat(rank: int, kind: str = "heartbeat", **capabilities: object) -> None:
            ranks.beat(f"rank-{rank}".encode(), kind, rank, **capabilities)

        beat(0, "hello")
        beat(1, "hello")
        executor.wait_until_serving(timeout=30)
        assert executor.draining_replicas() == frozenset()
        beat(1, draining=True)
        deadline = time.monotonic() + 30
        while not executor.draining_replicas():
            assert time.monotonic() < deadline, "the draining heartbeat was not seen"
            time.sleep(0.01)
        assert executor.draining_replicas() == {0} and executor.serving_replicas() == {0}
        assert [(e.kind, e.rank) for e in events if e.kind == "draining"] == [("draining", 1)]
        beat(1, draining=True)  # announced once
        beat(0)  # another rank's plain heartbeat leaves the replica draining
        time.sleep(0.2)
        assert executor.draining_replicas() == {0}
        assert sum(e.kind == "draining" for e in events) == 1
        ranks.goodbye(b"rank-1", rank=1)
        deadline = time.monotonic() + 30
        while executor.serving_replicas():
            assert time.monotonic() < deadline, "the goodbye was not seen"
            time.sleep(0.01)
        assert executor.draining_replicas() == frozenset()
    finally:
        ranks.close()
        executor.shutdown()


def test_a_rank_whose_output_flows_stays_a_member_while_its_heartbeats_are_late() -> None:
    """A rank whose streamed output and replies keep coming is alive, however late its heartbeats: a worker
    starved of CPU sends what it computes before its heartbeat thread gets a turn (CI's vLLM e2e lost three
    streams mid-way to 'no heartbeat for 3.0 s' while the replica streamed). Once nothing at all comes from it,
    it leaves after the heartbeat timeout, as before. A raw socket stands in for the rank."""
    interval = 0.5  # timeout: 1.5 s
    executor = raw_ranks_executor(interval)
    events: list[MembershipEvent] = []
    executor.subscribe(events.append)
    ranks = RawRanks(executor)
    item = {
        "id": "nobody-asked",  # the driver drops items of requests it does not know: only the sender matters
        "tokens": [5],
        "text": "a",
        "logprobs": None,
        "token_texts": None,
        "top_logprobs": None,
        "finish_reason": None,
        "error": None,
    }
    try:
        ranks.connect(b"rank-0")
        ranks.beat(b"rank-0", "hello")
        executor.wait_until_serving(timeout=30)
        # Four timeouts with no heartbeat: output every 0.1 s, a reply (to no pending call) now and then.
        flowing_until = time.monotonic() + 4 * executor.heartbeat_timeout_s
        n = 0
        while time.monotonic() < flowing_until:
            n += 1
            if n % 5:
                ranks.pushes[b"rank-0"].send_multipart(protocol.encode_stream(0, 0, [item]))
            else:
                ranks.pushes[b"rank-0"].send_multipart(protocol.encode_reply(10**6 + n, 0, 0, {"ok": True}))
            time.sleep(0.1)
        assert executor.serving_replicas() == {0}, [(e.kind, e.reason) for e in events]
        assert not [e for e in events if e.kind in ("left", "lost")], [(e.kind, e.reason) for e in events]
        silent_since = time.monotonic()
        deadline = silent_since + 30
        while executor.serving_replicas():
            assert time.monotonic() < deadline, "a rank that sends nothing at all stayed a member"
            time.sleep(0.05)
        assert time.monotonic() - silent_since >= executor.heartbeat_timeout_s - 0.2
    finally:
        ranks.close()
        executor.shutdown()


def test_a_heartbeat_after_its_goodbye_does_not_bring_the_process_back() -> None:
    """A worker's last heartbeat can reach the driver after its goodbye (scale to zero caught one in CI: the
    leaving replica served again, and took a request it then cut). That process stops: it stays out, while a
    process started anew for the rank (another routing id) joins. Raw sockets stand in for the ranks."""
    # A 30 s heartbeat (90 s timeout): the raw ranks beat only when the test says.
    executor = raw_ranks_executor(30)
    ranks = RawRanks(executor)
    try:
        ranks.connect(b"old")
        ranks.beat(b"old", "hello")
        executor.wait_until_serving(timeout=30)
        ranks.goodbye(b"old")
        deadline = time.monotonic() + 30
        while executor.serving_replicas():
            assert time.monotonic() < deadline, "the goodbye was not seen"
            time.sleep(0.01)
        ranks.beat(b"old", draining=True)  # sent before the goodbye, come in after it
        time.sleep(0.5)
        assert executor.serving_replicas() == frozenset() and executor.members() == []
        ranks.connect(b"new")
        ranks.beat(b"new", "hello")
        executor.wait_until_serving(timeout=30)
        assert [m.routing_id for m in executor.members()] == [b"new"]
    finally:
        ranks.close()
        executor.shutdown()


def test_a_stall_of_the_driver_itself_does_not_count_as_its_workers_silence() -> None:
    """The whole machine stalls (both cores taken, a paused container): the driver's I/O thread and the worker
    are silent together for longer than the heartbeat timeout. When the driver runs again, the worker's next
    heartbeat may not have arrived yet: the driver must not count its own stall as the worker's silence (CI lost
    a stream so, under four lanes). A worker that then stays silent is still dropped within the timeout. A raw
    socket stands in for the rank; the stall is the I/O thread's tick hook sleeping while the rank sends
    nothing."""
    interval, stall = 1.0, 4.5  # timeout 3 s, shorter than the stall
    executor = raw_ranks_executor(interval)
    ranks = RawRanks(executor)
    ranks.connect(b"rank")
    left: list[str] = []
    executor.subscribe(lambda event: left.append(event.reason) if event.kind == "left" else None)

    def beat(kind: str = "heartbeat") -> None:
        ranks.beat(b"rank", kind)

    stalling, resumed, stalls_again = threading.Event(), threading.Event(), threading.Event()
    tick = executor._on_tick

    def stalled_tick() -> None:
        if stalling.is_set() and not resumed.is_set():
            time.sleep(stall)
            resumed.set()
        if stalls_again.is_set():
            time.sleep(1.5 * interval)  # every turn: a driver that stalls over and over
        tick()

    executor._on_tick = stalled_tick  # type: ignore[method-assign]
    try:
        beat("hello")
        executor.wait_until_serving(timeout=30)
        stalling.set()  # the machine stalls: the I/O thread sleeps, the rank sends nothing
        assert resumed.wait(stall + 30)
        time.sleep(0.5)  # the I/O thread looks at the members' silence before the rank's next heartbeat
        assert left == [] and executor.serving_replicas() == {0}, left
        for _ in range(3):  # the rank beats again, as it does after a stall
            beat()
            last_beat = time.monotonic()
            time.sleep(interval)
        assert left == [] and executor.serving_replicas() == {0}, left
        # Now the rank is gone: dropped a timeout after its last heartbeat (and a tick or two).
        deadline = last_beat + 3 * interval + 10
        while not left:
            assert time.monotonic() < deadline, "a silent rank was never dropped"
            time.sleep(0.05)
        assert "no heartbeat" in left[0] and time.monotonic() - last_beat >= 3 * interval - 0.1, left
        # Back, then gone again while the driver stalls at every turn: its excuses are bounded (one timeout
        # since the last heartbeat), so the rank is still dropped.
        left.clear()
        beat("hello")
        executor.wait_until_serving(timeout=30)
        last_beat = time.monotonic()
        stalls_again.set()
        deadline = last_beat + 2 * 3 * interval + 30
        while not left:
            assert time.monotonic() < deadline, "a silent rank was never dropped by a driver that stalls"
            time.sleep(0.05)
        stalls_again.clear()
    finally:
        ranks.close()
        executor.shutdown()
