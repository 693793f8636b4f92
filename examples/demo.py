"""`make demo`: run examples/minilm.yaml with `iwg serve`, ask it for embeddings with the official `openai`
client, print what came back, stop the server.

    python -m examples.demo [--manifest examples/minilm.yaml] [--port 0]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

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

    from openai import OpenAI

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "iwg_worker.cli", "serve", str(args.manifest), "--port", str(port)]
    print(
        f"$ iwg serve {args.manifest.relative_to(ROOT) if args.manifest.is_relative_to(ROOT) else args.manifest}"
    )
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        wait_ready(url, server, args.timeout)
        print(f"ready after {time.monotonic() - started:.1f} s at {url}")

        client = OpenAI(base_url=f"{url}/v1", api_key="not-needed-locally", timeout=60, max_retries=0)
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
            print(
                f"  {sentence!r}\n    dimensions {len(vector)}, |v| = {norm:.4f}, first values [{head}, ...]"
            )
        a, b = (item.embedding for item in response.data)
        print(f"  cosine similarity of the two: {sum(x * y for x, y in zip(a, b, strict=True)):.4f}")
        print(f"  usage: {json.dumps(response.usage.model_dump())}")
        return 0
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
            print(f"server stopped (exit code {code})")


if __name__ == "__main__":
    sys.exit(main())
