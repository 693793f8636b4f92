"""worldSize > 1 means tensor parallelism: a model that cannot be sharded that many ways is refused, with the
architecture and the reason, before any weight is read (in the worker and in `iwg serve`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from iwg_worker.distributed import cuda_index
from iwg_worker.executor.multiproc import local_rank
from iwg_worker.models.sharding import (
    ShardingRefused,
    check_shardable,
    dividing_world_sizes,
    load_config,
)
from iwg_worker.torch_worker import TorchWorker
from iwg_worker.worker_base import WorkerConfig
from transformers import GPT2Config

from tests.iwg_worker.conftest import REPO_ROOT
from tests.models import smollm2_dir, smollm2_manifest


@pytest.fixture(scope="module")
def smollm2_config() -> object:
    return load_config(smollm2_dir(), local_files_only=True)


def model_without_weights(root: Path, config_dir: Path | None = None) -> Path:
    """A model directory whose configuration is real and whose weights file is not a weights file: loading
    the weights fails, so a refusal that names the architecture came before any weight was read."""
    root.mkdir()
    if config_dir is None:
        GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2).save_pretrained(root)
    else:
        (root / "config.json").write_text((config_dir / "config.json").read_text())
    (root / "model.safetensors").write_bytes(b"not safetensors")
    return root


def test_smollm2_shards_three_ways_not_two(smollm2_config: object) -> None:
    assert dividing_world_sizes(smollm2_config) == [1, 3]
    check_shardable(smollm2_config, 1)
    check_shardable(smollm2_config, 3)
    with pytest.raises(ShardingRefused) as refused:
        check_shardable(smollm2_config, 2)
    message = str(refused.value)
    assert "worldSize 2" in message and "LlamaForCausalLM" in message
    assert "9 attention heads" in message and "3 key/value heads" in message
    assert message.endswith("world sizes that divide them all: 1, 3")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_architectures_without_a_plan_are_refused_for_any_world_size_above_1(
    minilm_path: str, tmp_path: Path, world_size: int
) -> None:
    gpt2 = GPT2Config(architectures=["GPT2LMHeadModel"])
    bert = load_config(Path(minilm_path), local_files_only=True)
    for config, name in ((gpt2, "GPT2LMHeadModel"), (bert, "BertModel")):
        check_shardable(config, 1)  # one rank holds the whole model: nothing to shard
        with pytest.raises(ShardingRefused, match=f"architecture {name} has no tensor-parallel plan"):
            check_shardable(config, world_size)


@pytest.mark.parametrize("task", ["generate", "embed"])
def test_the_worker_refuses_before_it_reads_a_weight(tmp_path: Path, task: str) -> None:
    path = model_without_weights(tmp_path / "gpt2")
    worker = TorchWorker(WorkerConfig(task=task, model_path=str(path), device="cpu", world_size=2))
    # Refused in init_device, before the ranks meet: no rendezvous address is set, and none is needed.
    with pytest.raises(ShardingRefused, match="GPT2LMHeadModel has no tensor-parallel plan"):
        worker.init_device()
    # With one rank nothing is refused, and the same directory fails on its weights: the refusal came first.
    single = TorchWorker(WorkerConfig(task=task, model_path=str(path), device="cpu"))
    single.device = torch.device("cpu")
    with pytest.raises(Exception) as failed:
        single.load_model()
    assert not isinstance(failed.value, ShardingRefused)


def test_the_worker_refuses_smollm2_on_two_ranks_before_reading_weights(tmp_path: Path) -> None:
    path = model_without_weights(tmp_path / "smollm2", config_dir=smollm2_dir())
    worker = TorchWorker(
        WorkerConfig(task="generate", model_path=str(path), device="cpu", world_size=2, rank=1)
    )
    with pytest.raises(ShardingRefused, match="9 attention heads, 3 key/value heads"):
        worker.init_device()


def serve(manifest: dict[str, object], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "group.yaml").write_text(yaml.safe_dump(manifest))
    argv = [sys.executable, "-m", "iwg_worker.cli", "serve", str(tmp_path / "group.yaml"), "--port", "0"]
    # Its own session: if it started workers after all, they go with it.
    with subprocess.Popen(
        argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize(
    ("example", "world_size", "expected"),
    [
        ("smollm2.yaml", 2, "9 attention heads, 3 key/value heads"),
        ("minilm.yaml", 2, "architecture BertModel has no tensor-parallel plan"),
    ],
)
def test_iwg_serve_exits_at_start_naming_the_reason(
    minilm_path: str, tmp_path: Path, example: str, world_size: int, expected: str
) -> None:
    if example == "smollm2.yaml":
        manifest = smollm2_manifest()
    else:
        manifest = yaml.safe_load((REPO_ROOT / "examples" / example).read_text())
        manifest["spec"]["model"]["path"] = minilm_path
    manifest["spec"]["worldSize"] = world_size
    result = serve(manifest, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"iwg serve: spec.worldSize: worldSize {world_size}" in result.stderr
    assert expected in result.stderr
    assert "starting" not in result.stderr  # no worker was started


# -- one GPU per rank ----------------------------------------------------------------------------------------


def test_ranks_spread_over_the_gpus_of_a_machine() -> None:
    # Two replicas of three ranks on six GPUs: every rank has a GPU of its own.
    placed = [local_rank(replica, rank, 3, 6) for replica in range(2) for rank in range(3)]
    assert placed == [0, 1, 2, 3, 4, 5]
    # Three replicas of two ranks on four GPUs: replicas go round, a replica's ranks never share a GPU.
    for replica in range(3):
        assert len({local_rank(replica, rank, 2, 4) for rank in range(2)}) == 2
    assert [local_rank(2, rank, 2, 4) for rank in range(2)] == [0, 1]
    # No GPU: the rank itself (the CPU has no device index to choose).
    assert [local_rank(1, rank, 3, 0) for rank in range(3)] == [0, 1, 2]
    with pytest.raises(
        ValueError, match="worldSize 3 needs a GPU for each rank of a replica; this machine has 2"
    ):
        local_rank(0, 0, 3, 2)


def test_the_cuda_device_is_local_rank() -> None:
    assert cuda_index({"LOCAL_RANK": "2"}, device_count=4) == 2
    assert cuda_index({}, device_count=1) == 0
    with pytest.raises(ValueError, match="LOCAL_RANK=4 names no GPU: this process sees 4"):
        cuda_index({"LOCAL_RANK": "4"}, device_count=4)
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer"):
        cuda_index({"LOCAL_RANK": "first"}, device_count=4)


def test_multiproc_workers_get_their_local_rank() -> None:
    from iwg_worker.executor.multiproc import MultiprocExecutor

    with MultiprocExecutor(
        WorkerConfig(task="none", device="cpu", group="lr"),
        replicas=1,
        world_size=2,
        worker_extension_cls="tests.iwg_worker.extensions.ProbeExtension",
        startup_timeout_s=300,
    ) as executor:
        assert executor.collective_rpc("env_value", ("LOCAL_RANK",), timeout=60) == ["0", "1"]


@pytest.mark.skipif(
    torch.cuda.device_count() == 0, reason="no CUDA device: the CUDA path is not exercised here"
)
def test_a_worker_on_cuda_takes_the_gpu_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    index = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(index))
    worker = TorchWorker(WorkerConfig(task="none", device="cuda"))
    worker.init_device()
    assert worker.device == torch.device("cuda", index)
