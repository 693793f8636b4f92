"""`make demo-local`: run examples/minilm.yaml with `iwg serve`, ask it for embeddings with the official
`openai` client and print what came back; then the same for examples/smollm2.yaml (its model path on the
converted SmolLM2 directory, which loads in about a second), whose chat answer is streamed to the terminal;
stop both servers. The SmolLM2 server starts at the beginning, so it loads while the embeddings run.

    python -m examples.demo [--manifest examples/minilm.yaml] [--port 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [
    "A platform engineer applies an InferenceWorkerGroup.",
    "The operator schedules GPU workers and wires them to the driver.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"iwg serve exited with code {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/readyz did not answer 200 within {timeout:.0f} s")


@contextlib.contextmanager
def serving(manifest: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """`iwg serve MANIFEST --port PORT` as a subprocess, stopped (SIGTERM, then its exit code) on the way out."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "iwg_worker.cli", "serve", str(manifest), "--port", str(port)]
    print(
        f"$ iwg serve {manifest.relative_to(ROOT) if manifest.is_relative_to(ROOT) else manifest} --port {port}"
    )
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    try:
        yield server
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
            print(f"server on port {port} stopped (exit code {code})")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "minilm.yaml")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the group to be ready"
    )
    args = parser.parse_args()

    import yaml
    from openai import OpenAI

    from examples.chat import stream_chat
    from tests.models import smollm2_manifest

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    chat_port = free_port()
    chat_url = f"http://127.0.0.1:{chat_port}"
    with tempfile.TemporaryDirectory(prefix="iwg-demo-") as tmp:
        chat_manifest = Path(tmp) / "smollm2.yaml"
        chat_manifest.write_text(yaml.safe_dump(smollm2_manifest()))
        with serving(args.manifest, port) as server, serving(chat_manifest, chat_port) as chat_server:
            started = time.monotonic()
            wait_ready(url, server, args.timeout)
            print(f"ready after {time.monotonic() - started:.1f} s at {url}")
            client = OpenAI(base_url=f"{url}/v1", api_key="not-needed-locally", timeout=60, max_retries=0)
            embed(client)

            wait_ready(chat_url, chat_server, args.timeout)
            print(f"SmolLM2 ready after {time.monotonic() - started:.1f} s at {chat_url}")
            chat = OpenAI(base_url=f"{chat_url}/v1", api_key="not-needed-locally", timeout=120, max_retries=0)
            stream_chat(chat, chat.models.list().data[0].id)
    return 0


def embed(client: OpenAI) -> None:
    model = client.models.list().data[0].id
    started = time.perf_counter()
    client.embeddings.create(model=model, input="warm-up")
    print(f"first request (cold worker): {(time.perf_counter() - started) * 1000:.1f} ms")
    started = time.perf_counter()
    response = client.embeddings.create(model=model, input=SENTENCES)
    latency_ms = (time.perf_counter() - started) * 1000
    print(f"model {response.model}: {len(response.data)} embeddings in {latency_ms:.1f} ms")
    for sentence, item in zip(SENTENCES, response.data, strict=True):
        vector = item.embedding
        norm = sum(x * x for x in vector) ** 0.5
        head = ", ".join(f"{x:+.4f}" for x in vector[:5])
        print(f"  {sentence!r}\n    dimensions {len(vector)}, |v| = {norm:.4f}, first values [{head}, ...]")
    a, b = (item.embedding for item in response.data)
    print(f"  cosine similarity of the two: {sum(x * y for x, y in zip(a, b, strict=True)):.4f}")
    print(f"  usage: {json.dumps(response.usage.model_dump())}")


if __name__ == "__main__":
    sys.exit(main())
