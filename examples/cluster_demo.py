"""`make demo`: the example group through the whole path, on this machine.

A local control plane (real kube-apiserver, scheduler, controller manager), the operator, and the node
agent that runs pods as real processes; `kubectl apply` of examples/minilm.yaml and examples/smollm2.yaml
(its model path on the converted SmolLM2 directory, which loads in about a second); a real embedding request,
then a chat answer from SmolLM2 streamed to the terminal, both with the official `openai` client through the
groups' driver Services; `kubectl get iwg`; then everything is torn down. Needs root (the node agent makes a
network namespace per pod). `make demo-local` runs the same groups with `iwg serve` instead, without
Kubernetes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [
    "A platform engineer applies an InferenceWorkerGroup.",
    "The operator schedules GPU workers and wires them to the driver.",
]


def main() -> int:
    if os.geteuid() != 0:
        print(
            "make demo needs root (network namespaces for the pods); `make demo-local` runs iwg serve instead"
        )
        return 2
    import numpy as np
    import yaml
    from iwg_operator.api.v1alpha1 import load_manifest
    from iwg_operator.builders.common import driver_name

    from examples.chat import stream_chat
    from tests.e2e.harness import openai_client, wait_serving
    from tests.e2e.stack import LocalStack
    from tests.models import smollm2_manifest

    manifest_path = ROOT / "examples" / "minilm.yaml"
    manifest = load_manifest(manifest_path)
    chat_manifest = smollm2_manifest()
    chat = load_manifest(chat_manifest)
    print("starting a local cluster:")
    with LocalStack(namespace="demo") as stack:
        assert stack.control_plane is not None and stack.agent is not None
        applied = time.monotonic()
        print(f"$ kubectl apply -n demo -f {manifest_path.relative_to(ROOT)}")
        print(stack.control_plane.kubectl("apply", "-n", "demo", "-f", str(manifest_path)).stdout.strip())
        print(f"$ kubectl apply -n demo -f examples/smollm2.yaml  # model.path: {chat.spec.model.path}")
        done = stack.control_plane.kubectl(
            "apply", "-n", "demo", "-f", "-", input=yaml.safe_dump(chat_manifest)
        )
        print(done.stdout.strip())
        address = wait_serving(
            stack.groups, stack.core, stack.agent, manifest.name, manifest.spec.replicas, 300
        )
        service = f"{driver_name(manifest.name)}.demo.svc.cluster.local"
        print(f"{manifest.name} serving after {time.monotonic() - applied:.1f} s; {service} -> {address}")

        api = openai_client(address, manifest.spec.driver.port)
        started = time.perf_counter()
        result = api.embeddings.create(model=manifest.served_name, input=SENTENCES)
        elapsed = (time.perf_counter() - started) * 1000
        vectors = np.array([d.embedding for d in result.data])
        print(
            f"POST /v1/embeddings ({len(SENTENCES)} inputs) -> {vectors.shape[1]} dims each, {elapsed:.1f} ms"
        )
        for sentence, vector in zip(SENTENCES, vectors, strict=True):
            print(f"  {sentence[:50]:<50} [{', '.join(f'{x:+.4f}' for x in vector[:4])}, ...]")
        print(f"  cosine between the two: {float(vectors[0] @ vectors[1]):.4f}")

        address = wait_serving(stack.groups, stack.core, stack.agent, chat.name, chat.spec.replicas, 300)
        service = f"{driver_name(chat.name)}.demo.svc.cluster.local"
        print(f"{chat.name} serving after {time.monotonic() - applied:.1f} s; {service} -> {address}")
        stream_chat(openai_client(address, chat.spec.driver.port), chat.served_name)
        print("$ kubectl get iwg -n demo")
        print(stack.control_plane.kubectl("get", "iwg", "-n", "demo").stdout.rstrip())
        print("tearing down")
    print("done: every process stopped, every namespace, link and file removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
