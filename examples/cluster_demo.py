"""`make demo`: the example groups through the whole path, on this machine.

A local control plane (real kube-apiserver, scheduler, controller manager) and two real nodes (each a kubelet
with its own containerd, kube-proxy, and CoreDNS for names; tests/realnodes/nodes.py), the operator;
`kubectl apply` of examples/minilm.yaml and examples/smollm2.yaml, each with its worker image replaced by the
light test image every node has imported (the worker image is on no registry this machine reaches) and CPUs
that fit two 2-CPU nodes, SmolLM2's converted model on a volume (a hostPath PersistentVolume and its claim); a
real embedding request, then a chat answer from SmolLM2 streamed to the terminal, both with the official
`openai` client through the groups' driver Services (their ClusterIPs, through a node's kube-proxy); `kubectl
get iwg`; then everything is torn down. Needs root (namespaces, cgroups, containerd) and a checkout outside
/tmp. `make demo-local` runs the same groups with `iwg serve` instead, without Kubernetes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [
    "A platform engineer applies an InferenceWorkerGroup.",
    "The operator schedules GPU workers and wires them to the driver.",
]


def main() -> int:
    if os.geteuid() != 0:
        print(
            "make demo needs root (real nodes: namespaces, cgroups, containerd); `make demo-local` runs iwg serve"
        )
        return 2
    if ROOT.is_relative_to("/tmp"):
        print(f"make demo cannot run from {ROOT}: the pods mount their own /tmp over it; clone elsewhere")
        return 2
    import numpy as np
    import yaml
    from iwg_operator.api.v1alpha1 import load_manifest

    from examples.chat import stream_chat
    from tests.e2e.harness import openai_client
    from tests.models import smollm2_manifest
    from tests.realnodes.fixture import real_cluster_running
    from tests.realnodes.nodes import WORKER_IMAGE

    namespace = "demo"
    light = {"image": WORKER_IMAGE, "imagePullPolicy": "Never"}
    manifest_path = ROOT / "examples" / "minilm.yaml"
    embed = yaml.safe_load(manifest_path.read_text())
    embed["spec"]["worker"].update(light, cpu="500m")
    embed["spec"]["driver"].update(cpu="500m")
    manifest = load_manifest(embed)
    chat_manifest = smollm2_manifest()
    chat_manifest["spec"]["worker"].update(light, cpu="1")
    chat_manifest["spec"]["driver"].update(cpu="500m")
    print("starting a local cluster:")
    with real_cluster_running(namespace=namespace, log=print) as cluster:
        volume = cluster.model_volume("smollm2", Path(chat_manifest["spec"]["model"]["path"]))
        chat_manifest["spec"]["model"].update(volume=volume, path=volume["mountPath"])
        chat = load_manifest(chat_manifest)
        kubectl = cluster.control_plane.kubectl
        applied = time.monotonic()
        print(f"$ kubectl apply -n {namespace} -f {manifest_path.relative_to(ROOT)}  # image {WORKER_IMAGE}")
        print(kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(embed)).stdout.strip())
        print(
            f"$ kubectl apply -n {namespace} -f examples/smollm2.yaml  # model on the claim {volume['claimName']}"
        )
        print(
            kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(chat_manifest)).stdout.strip()
        )

        port = cluster.wait_serving(manifest.name, manifest.spec.replicas, 300)
        print(
            f"{manifest.name} serving after {time.monotonic() - applied:.1f} s; {service(cluster, manifest.name)}"
        )
        api = openai_client("127.0.0.1", port)
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

        port = cluster.wait_serving(chat.name, chat.spec.replicas, 300)
        print(f"{chat.name} serving after {time.monotonic() - applied:.1f} s; {service(cluster, chat.name)}")
        stream_chat(openai_client("127.0.0.1", port), chat.served_name)
        print(f"$ kubectl get iwg -n {namespace}")
        print(kubectl("get", "iwg", "-n", namespace).stdout.rstrip())
        print(f"$ kubectl get pods -n {namespace} -o wide")
        print(kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout.rstrip())
        print("tearing down")
    print("done: every process stopped, every namespace, cgroup and file removed")
    return 0


def service(cluster: Any, group: str) -> str:
    """Where the demo reaches a group: its driver Service's ClusterIP, through the first node's kube-proxy."""
    from iwg_operator.builders.common import driver_name

    found = cluster.core.read_namespaced_service(driver_name(group), cluster.namespace)
    return (
        f"Service {driver_name(group)} {found.spec.cluster_ip}:{found.spec.ports[0].port} "
        f"(reached through {cluster.nodes.names[0]}'s kube-proxy)"
    )


if __name__ == "__main__":
    sys.exit(main())
