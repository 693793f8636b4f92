"""TorchWorker with real torch and real weights: MiniLM against sentence-transformers, a causal LM
against transformers' own greedy decoding, the device chosen rather than assumed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from iwg_worker.executor.base import RPCError
from iwg_worker.executor.uniproc import UniProcExecutor
from iwg_worker.torch_worker import TorchWorker, auto_dtype, cgroup_memory, host_memory_info
from iwg_worker.worker_base import WorkerConfig

from .conftest import SENTENCES


@pytest.fixture(scope="module")
def embed_executor(minilm_path: str) -> UniProcExecutor:
    executor = UniProcExecutor(WorkerConfig(task="embed", model_path=minilm_path, device="cpu"))
    yield executor  # type: ignore[misc]
    executor.shutdown()


def test_minilm_embeddings_match_sentence_transformers(
    embed_executor: UniProcExecutor, minilm_path: str
) -> None:
    from sentence_transformers import SentenceTransformer

    oracle = SentenceTransformer(minilm_path, device="cpu")
    expected = torch.from_numpy(oracle.encode(SENTENCES, convert_to_numpy=True))
    got = embed_executor.execute_model({"inputs": SENTENCES})["embeddings"]
    assert got.shape == expected.shape == (len(SENTENCES), 384)
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    assert bool((cosine >= 0.9999).all()), cosine
    assert torch.allclose(got.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_cpu_worker_says_so_in_its_health_report(embed_executor: UniProcExecutor) -> None:
    (report,) = embed_executor.check_health()
    assert report["cpu"] is True and report["device"] == "cpu" and report["device_note"].startswith("CPU")
    assert report["model_loaded"] is True and report["device_available"] is True
    assert 0 < report["memory_free_bytes"] <= report["memory_total_bytes"]
    assert report["last_step_s"] is not None  # the embedding test above ran a step


def test_bad_batch_names_the_field(embed_executor: UniProcExecutor) -> None:
    with pytest.raises(Exception, match="'inputs'"):
        embed_executor.execute_model({"texts": ["a"]})


def test_cuda_requested_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: this test covers the CPU-only case")
    worker = TorchWorker(WorkerConfig(device="cuda"))
    with pytest.raises(RuntimeError, match="no CUDA device"):
        worker.init_device()


def test_auto_device_picks_what_is_there() -> None:
    worker = TorchWorker(WorkerConfig(device="auto"))
    worker.init_device()
    assert worker.device is not None
    assert worker.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_minilm_on_cuda_matches_cpu(minilm_path: str, embed_executor: UniProcExecutor) -> None:
    if not torch.cuda.is_available():
        pytest.skip("GPU path NOT exercised: no CUDA device on this machine")
    gpu = UniProcExecutor(WorkerConfig(task="embed", model_path=minilm_path, device="cuda", dtype="float32"))
    try:
        on_gpu = gpu.execute_model({"inputs": SENTENCES})["embeddings"]
        on_cpu = embed_executor.execute_model({"inputs": SENTENCES})["embeddings"]
        assert bool((torch.nn.functional.cosine_similarity(on_gpu, on_cpu, dim=1) >= 0.9999).all())
        assert gpu.check_health()[0]["cpu"] is False
    finally:
        gpu.shutdown()


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        ({"torch_dtype": "float16"}, "cuda", torch.float16),
        ({"torch_dtype": "bfloat16"}, "cuda", torch.bfloat16),
        ({"dtype": "bfloat16"}, "cuda", torch.bfloat16),  # newer transformers write `dtype`
        ({"torch_dtype": "float32"}, "cuda", torch.float32),
        ({}, "cuda", torch.float32),
        (None, "cuda", torch.float32),
        ({"torch_dtype": "float16"}, "cpu", torch.float32),
        ({"torch_dtype": "bfloat16"}, "cpu", torch.float32),
        ({"torch_dtype": "float32"}, "cpu", torch.float32),
    ],
)
def test_auto_dtype_is_the_models_own_but_float32_for_half_models_on_cpu(
    config: dict[str, str] | None, device: str, expected: torch.dtype
) -> None:
    assert auto_dtype(config, device) == expected


def test_auto_dtype_reads_the_model_directory(tmp_path: Path, minilm_path: str) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    worker = TorchWorker(WorkerConfig(model_path=str(tmp_path), device="auto"))
    worker.init_device()
    on_gpu = worker.device is not None and worker.device.type == "cuda"
    assert worker.dtype == (torch.bfloat16 if on_gpu else torch.float32)
    # MiniLM's config says float32: auto keeps it, on a GPU too (it used to become float16 there).
    minilm = TorchWorker(WorkerConfig(model_path=minilm_path, device="auto"))
    minilm.init_device()
    assert minilm.dtype == torch.float32


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2, eos_token_id=96)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


async def test_a_generate_worker_streams_greedy_tokens_equal_to_transformers(tiny_gpt2: Path) -> None:
    from transformers import GPT2LMHeadModel

    executor = UniProcExecutor(
        WorkerConfig(task="generate", model_path=str(tiny_gpt2), device="cpu", engine="transformers")
    )
    oracle = GPT2LMHeadModel.from_pretrained(tiny_gpt2).eval()
    try:
        for n, prompt in enumerate([[5, 17, 42], [1, 2]]):
            request = {"id": f"r{n}", "prompt_ids": prompt, "max_tokens": 6, "temperature": 0.0}
            stream, answer = await executor.open_stream(request, replica=0)
            assert answer == {"id": f"r{n}", "ok": True, "prompt_tokens": len(prompt)}
            tokens = [t async for item in stream for t in item["tokens"]]
            expected = oracle.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=96
            )[0, len(prompt) :].tolist()
            assert tokens == expected
        # A model without a tokenizer takes token ids only; a text prompt is refused for that request.
        _stream, refused = await executor.open_stream({"id": "text", "prompt": "hello"}, replica=0)
        assert refused["ok"] is False and refused["error"]["param"] == "prompt"
        with pytest.raises(RPCError, match="engine_add"):
            executor.execute_model({"input_ids": [[1, 2]], "max_tokens": 2})
    finally:
        executor.shutdown()


def test_memory_this_process_may_use_is_bounded_by_its_cgroups_limit(tmp_path: Path) -> None:
    """A pod's memory limit, not the node's memory, bounds what the engines size their KV cache by (a vLLM
    worker in a 4 GiB pod on a 24 GiB node asked for a 2 GiB cache with 1.2 GiB left, and did not start)."""
    gib = 1024**3
    host_available, host_total = host_memory_info(tmp_path / "none")  # no cgroup files: the host's own
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{4 * gib}\n")
    (v2 / "memory.current").write_text(f"{3 * gib}\n")
    assert cgroup_memory(v2) == (4 * gib, 3 * gib)
    available, total = host_memory_info(v2)
    assert total == min(host_total, 4 * gib) and available <= gib
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * gib}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{gib // 2}\n")
    assert cgroup_memory(v1) == (2 * gib, gib // 2)
    assert host_memory_info(v1)[1] == min(host_total, 2 * gib)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory(v1) is None and cgroup_memory(v2) is None
    assert host_memory_info(v2)[1] == host_total and host_available > 0
