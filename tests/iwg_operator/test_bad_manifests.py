"""Bad InferenceWorkerGroups: the API server refuses them naming the field, and `load_manifest` (iwg serve)
refuses the same ones naming the same field. What admission cannot know (the pod it would produce is
invalid, a PriorityClass is missing, a name is taken) the operator marks with a condition and one Event,
without crashing and without a retry storm.
"""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import pytest
from iwg_operator.api import v1alpha1 as api
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster

_DROP = object()
CEL_SKIPPED = (
    "<nil>: Invalid value: null: some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)

# (case id, path to change, new value (or _DROP), the field the error must name)
ADMISSION_CASES: list[tuple[str, tuple[str | int, ...], Any, str]] = [
    ("no-spec", ("spec",), _DROP, "spec"),
    ("no-model", ("spec", "model"), _DROP, "spec.model"),
    ("no-task", ("spec", "model", "task"), _DROP, "spec.model.task"),
    ("task-enum", ("spec", "model", "task"), "classify", "spec.model.task"),
    ("empty-path", ("spec", "model", "path"), "", "spec.model.path"),
    ("dtype-enum", ("spec", "model", "dtype"), "int4", "spec.model.dtype"),
    ("engine-enum", ("spec", "model", "engine"), "tensorrt", "spec.model.engine"),
    ("engine-vllm-embed", ("spec", "model", "engine"), "vllm", "spec.model.engine"),
    ("enforce-eager-type", ("spec", "model", "enforceEager"), "maybe", "spec.model.enforceEager"),
    ("enforce-eager-transformers", ("spec", "model"), {"task": "generate", "path": "/models/m",
     "engine": "transformers", "enforceEager": True}, "spec.model.enforceEager"),
    ("chat-template-embed", ("spec", "model", "chatTemplate"), "{{ messages }}", "spec.model.chatTemplate"),
    ("chat-template-empty", ("spec", "model"), {"task": "generate", "path": "/models/m", "chatTemplate": ""},
     "spec.model.chatTemplate"),
    ("served-name", ("spec", "model", "servedName"), "has space", "spec.model.servedName"),
    ("volume-path", ("spec", "model", "volume"), {"claimName": "models", "mountPath": "/data"}, "spec.model.path"),
    ("replicas-negative", ("spec", "replicas"), -1, "spec.replicas"),
    ("replicas-too-many", ("spec", "replicas"), 1001, "spec.replicas"),
    ("replicas-string", ("spec", "replicas"), "two", "spec.replicas"),
    ("world-zero", ("spec", "worldSize"), 0, "spec.worldSize"),
    ("world-too-big", ("spec", "worldSize"), 65, "spec.worldSize"),
    ("gpus-too-many", ("spec", "worker", "gpus"), 17, "spec.worker.gpus"),
    ("gpus-negative", ("spec", "worker", "gpus"), -1, "spec.worker.gpus"),
    ("cpu-quantity", ("spec", "worker", "cpu"), "lots", "spec.worker.cpu"),
    ("memory-quantity", ("spec", "worker", "memory"), "1.5.3Gi", "spec.worker.memory"),
    ("shm-quantity", ("spec", "worker", "shmSize"), "big", "spec.worker.shmSize"),
    ("shm-negative", ("spec", "worker", "shmSize"), "-1Gi", "spec.worker.shmSize"),
    ("env-reserved-iwg", ("spec", "worker", "env"), [{"name": "IWG_RANK", "value": "0"}], "spec.worker.env"),
    ("env-reserved-torch", ("spec", "worker", "env"), [{"name": "MASTER_ADDR", "value": "x"}], "spec.worker.env"),
    ("env-bad-name", ("spec", "worker", "env"), [{"name": "1BAD", "value": "x"}], "spec.worker.env[0].name"),
    ("worker-cls", ("spec", "worker", "workerCls"), "not a class", "spec.worker.workerCls"),
    ("extension-cls", ("spec", "worker", "workerExtensionCls"), "NoModule", "spec.worker.workerExtensionCls"),
    ("cuda-without-gpu", ("spec", "worker"), {"gpus": 0, "device": "cuda"}, "spec.worker.device"),
    ("pull-policy", ("spec", "worker", "imagePullPolicy"), "Sometimes", "spec.worker.imagePullPolicy"),
    ("unknown-field", ("spec", "worker", "gpu"), 1, "spec.worker.gpu"),
    ("driver-port-zero", ("spec", "driver", "port"), 0, "spec.driver.port"),
    ("driver-port-high", ("spec", "driver", "port"), 70000, "spec.driver.port"),
    ("batch-zero", ("spec", "driver", "batching"), {"maxBatchSize": 0}, "spec.driver.batching.maxBatchSize"),
    ("queue-below-batch", ("spec", "driver", "batching"), {"maxBatchSize": 64, "maxQueue": 8},
     "spec.driver.batching.maxQueue"),
    ("toleration-operator", ("spec", "scheduling", "tolerations"), [{"key": "a", "operator": "Maybe"}],
     "spec.scheduling.tolerations[0].operator"),
    ("toleration-exists-value", ("spec", "scheduling", "tolerations"),
     [{"key": "a", "operator": "Exists", "value": "x"}], "spec.scheduling.tolerations[0].value"),
    ("gpus-exceed-node", ("spec",), {"model": {"task": "embed", "path": "/m"}, "worldSize": 4,
     "worker": {"gpus": 4}, "scheduling": {"colocateRanks": True, "gpusPerNode": 8}}, "spec.worker.gpus"),
    ("product-without-gpu", ("spec",), {"model": {"task": "embed", "path": "/m"}, "worker": {"gpus": 0},
     "scheduling": {"gpuProduct": "NVIDIA-H100-80GB-HBM3"}}, "spec.scheduling.gpuProduct"),
    ("restart-policy", ("spec", "health", "restartPolicy"), "Node", "spec.health.restartPolicy"),
    ("timeout-over-period", ("spec", "health"), {"periodSeconds": 5, "timeoutSeconds": 10},
     "spec.health.timeoutSeconds"),
    ("failure-threshold", ("spec", "health", "failureThreshold"), 0, "spec.health.failureThreshold"),
    ("min-over-max", ("spec", "autoscaling"), {"minReplicas": 5, "maxReplicas": 2}, "spec.autoscaling.minReplicas"),
    ("metric-enum", ("spec", "autoscaling", "metric"), "cpu", "spec.autoscaling.metric"),
    ("tolerance-range", ("spec", "autoscaling", "tolerance"), 1.5, "spec.autoscaling.tolerance"),
    ("kv-usage-target", ("spec", "autoscaling"), {"metric": "kvCacheUsage", "target": 4},
     "spec.autoscaling.target"),
    ("max-unavailable", ("spec", "rollout", "maxUnavailable"), 0, "spec.rollout.maxUnavailable"),
    ("name-too-long", ("metadata", "name"), "n" * 41, "metadata.name"),
    ("name-not-dns", ("metadata", "name"), "9lives", "metadata.name"),
    # Paths are checked as paths: a string prefix is not "under", `..` escapes, `pkg:` needs module/subdir.
    ("path-string-prefix", ("spec", "model"), {"task": "embed", "path": "/models2/m",
     "volume": {"claimName": "c", "mountPath": "/models"}}, "spec.model.path"),
    ("path-dotdot-escape", ("spec", "model"), {"task": "embed", "path": "/models/../etc/m",
     "volume": {"claimName": "c", "mountPath": "/models"}}, "spec.model.path"),
    ("path-dotdot", ("spec", "model", "path"), "/opt/m/../../etc", "spec.model.path"),
    ("mount-path-dotdot", ("spec", "model"), {"task": "embed", "path": "/data/x/../m",
     "volume": {"claimName": "c", "mountPath": "/data/x/.."}}, "spec.model.volume.mountPath"),
    ("mount-path-taken", ("spec", "model"), {"task": "embed", "path": "/tmp/m",
     "volume": {"claimName": "c", "mountPath": "/tmp"}}, "spec.model.volume.mountPath"),
    ("mount-path-under-curve", ("spec", "model"), {"task": "embed", "path": "/etc/iwg/curve/m/x",
     "volume": {"claimName": "c", "mountPath": "/etc/iwg/curve/m"}}, "spec.model.volume.mountPath"),
    ("pkg-not-module", ("spec", "model", "path"), "pkg:not a module/m", "spec.model.path"),
    ("pkg-no-subdir", ("spec", "model", "path"), "pkg:iwg_worker", "spec.model.path"),
    ("pkg-absolute-subdir", ("spec", "model", "path"), "pkg:iwg_worker//etc", "spec.model.path"),
    ("path-nul", ("spec", "model", "path"), "/models/m\x00x", "spec.model.path"),
    ("image-space", ("spec", "worker", "image"), " worker:1", "spec.worker.image"),
    ("image-shell", ("spec", "worker", "image"), "worker:1; rm -rf /", "spec.worker.image"),
    ("driver-image-shell", ("spec", "driver", "image"), "$(curl x)", "spec.driver.image"),
    ("memory-overflow", ("spec", "worker", "memory"), "1e3000", "spec.worker.memory"),
    ("cpu-overflow", ("spec", "worker", "cpu"), 10**17, "spec.worker.cpu"),
    ("shm-overflow", ("spec", "worker", "shmSize"), "9Ei", "spec.worker.shmSize"),
    ("driver-memory-overflow", ("spec", "driver", "memory"), "1e19", "spec.driver.memory"),
    ("env-nul", ("spec", "worker", "env"), [{"name": "A", "value": "a\x00b"}], "spec.worker.env[0].value"),
    ("affinity-misspelt", ("spec", "scheduling", "affinity"), {"nodeAffinity": {
     "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpresions": []}]}}},
     "spec.scheduling.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"),
    ("affinity-unknown-kind", ("spec", "scheduling", "affinity"), {"nodeAfinity": {}},
     "spec.scheduling.affinity"),
    ("gpu-product-label", ("spec", "scheduling", "gpuProduct"), "H100 80GB", "spec.scheduling.gpuProduct"),
    ("driver-port-rpc", ("spec", "driver", "port"), 5555, "spec.driver.port"),
    ("driver-port-response", ("spec", "driver", "port"), 5556, "spec.driver.port"),
    ("tmp-quantity", ("spec", "worker", "tmpSize"), "big", "spec.worker.tmpSize"),
    ("driver-tmp-overflow", ("spec", "driver", "tmpSize"), "9Ei", "spec.driver.tmpSize"),
    ("driver-cpu-quantity", ("spec", "driver", "cpu"), "fast", "spec.driver.cpu"),
    ("http-from-empty-peer", ("spec", "driver", "networkPolicy"), {"httpFrom": [{}]},
     "spec.driver.networkPolicy.httpFrom[0]"),
    ("http-from-ip-and-pods", ("spec", "driver", "networkPolicy"),
     {"httpFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]},
     "spec.driver.networkPolicy.httpFrom[0].ipBlock"),
    ("http-from-misspelt", ("spec", "driver", "networkPolicy"), {"httpFrom": [{"podSelecter": {}}]},
     "spec.driver.networkPolicy.httpFrom[0].podSelecter"),
    ("http-from-selector-operator", ("spec", "driver", "networkPolicy"),
     {"httpFrom": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Maybe"}]}}]},
     "spec.driver.networkPolicy.httpFrom[0].podSelector.matchExpressions[0].operator"),
    ("http-from-cidr", ("spec", "driver", "networkPolicy"), {"httpFrom": [{"ipBlock": {"cidr": "10.0.0.0"}}]},
     "spec.driver.networkPolicy.httpFrom[0].ipBlock.cidr"),
    ("http-from-except", ("spec", "driver", "networkPolicy"),
     {"httpFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/99"]}}]},
     "spec.driver.networkPolicy.httpFrom[0].ipBlock.except"),
]  # fmt: skip


def mutated(namespace: str, path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {"model": {"task": "embed", "path": "/models/m"}},
    }
    target: Any = manifest
    for key in path[:-1]:
        target = target.setdefault(key, {})
    if value is _DROP:
        del target[path[-1]]
    else:
        target[path[-1]] = copy.deepcopy(value)
    return manifest


def normalized(text: str) -> str:
    return re.sub(r"\[\d*\]", "", text)


def test_table_of_bad_manifests_is_large_enough() -> None:
    assert len(ADMISSION_CASES) + len(OPERATOR_CASES) >= 30
    assert len({case[0] for case in ADMISSION_CASES}) == len(ADMISSION_CASES)


@pytest.mark.parametrize(
    ("case", "path", "value", "field"), ADMISSION_CASES, ids=[c[0] for c in ADMISSION_CASES]
)
def test_api_server_and_load_manifest_refuse_naming_the_field(
    iwg_crd: Any, k8s: Any, namespace: str, case: str, path: tuple[str | int, ...], value: Any, field: str
) -> None:
    manifest = mutated(namespace, path, value)
    custom = client.CustomObjectsApi(k8s)
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, manifest, field_validation="Strict"
        )
    assert refused.value.status in (400, 422), refused.value.body
    message = json.loads(refused.value.body)["message"]
    assert field in message, f"API server message does not name {field}: {message}"
    # The server's own note that schema errors kept CEL rules from running has no field; any other has one.
    assert "<nil>" not in message.replace(CEL_SKIPPED, ""), f"a rule without a field path: {message}"

    with pytest.raises(api.ManifestError) as local:
        api.load_manifest(manifest)
    assert normalized(field) in normalized(str(local.value)), (
        f"load_manifest does not name {field}: {local.value}"
    )


# Groups that pass admission but whose pods or children the API server refuses: (case, spec, words in the condition)
# The condition names the group's field a pod field came from, never the pod's own name for it.
OPERATOR_CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("affinity-invalid", {"scheduling": {"affinity": {"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}, "topologyKey": ""}]}}}},
     ("spec.scheduling.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey",)),
    ("node-selector-key", {"scheduling": {"nodeSelector": {"bad key!": "x"}}}, ("spec.scheduling.nodeSelector",)),
    ("priority-class-missing", {"scheduling": {"priorityClassName": "no-such-class"}}, ("PriorityClass",)),
    ("toleration-key", {"scheduling": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}},
     ("spec.scheduling.tolerations[0].key",)),
    ("driver-service-taken", {}, ("Service", "not owned")),
]  # fmt: skip


def test_operator_marks_what_admission_cannot_know_without_crashing_or_looping(
    groups: Groups, operator: Any, k8s: Any
) -> None:
    core = client.CoreV1Api(k8s)
    # Someone else's Service already has the name the driver Service needs.
    core.create_namespaced_service(
        groups.namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="taken-driver"),
            spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)]),
        ),
    )
    names = {}
    for case, spec, _ in OPERATOR_CASES:
        name = "taken" if case == "driver-service-taken" else case
        names[case] = name
        groups.create(name, replicas=1, worker=spec.pop("worker", {"gpus": 0}), **spec)

    for case, _, words in OPERATOR_CASES:
        name = names[case]
        failed = eventually(
            lambda name=name: (
                (c := groups.condition(name, "ReconcileFailed")) and c["status"] == "True" and c
            ),
            timeout=30,
            what=f"{case}: ReconcileFailed condition",
        )
        assert all(word in failed["message"] for word in words), (case, failed["message"])
        degraded = groups.condition(name, "Degraded")
        assert degraded is not None and degraded["status"] == "True", case
        assert groups.get(name)["status"]["phase"] == "Failed", case

    # Retries back off and the Event is posted once per distinct refusal: no storm.
    time.sleep(6)
    for case, _, _ in OPERATOR_CASES:
        refusals = [e for e in groups.events(names[case]) if e.reason == "ReconcileFailed"]
        assert len(refusals) == 1, (case, [e.message for e in refusals])
        assert refusals[0].type == "Warning"
        assert len(groups.live_pods(names[case])) <= 1, case

    # Fixing the spec clears the condition: the operator was waiting, not stuck.
    groups.patch("affinity-invalid", {"scheduling": {"affinity": None}})
    eventually(
        lambda: (c := groups.condition("affinity-invalid", "ReconcileFailed")) and c["status"] == "False",
        timeout=60,
        what="condition cleared after the fix",
    )
    assert len(groups.live_pods("affinity-invalid")) == 1


@pytest.fixture
def short_scheduling_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator reports pods no scheduler picked up after 3 s instead of 60 s (set before it starts)."""
    monkeypatch.setenv("IWG_SCHEDULING_TIMEOUT_S", "3")


def test_pods_no_scheduler_picks_up_are_reported_and_never_called_placed(
    short_scheduling_timeout: None, scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any
) -> None:
    groups.create("ghost", replicas=2, worker={"gpus": 0}, scheduling={"schedulerName": "no-such-scheduler"})
    groups.create("placed", replicas=1, worker={"gpus": 1})

    bound = eventually(
        lambda: (c := groups.condition("placed", "Unschedulable")) and c["reason"] == "Scheduled" and c,
        timeout=60,
        what="the default scheduler's pods bound",
    )
    assert bound["status"] == "False" and bound["message"] == "all pods bound to nodes"
    assert all(pod.spec.node_name for pod in groups.live_pods("placed"))

    # The two pods pass the 3 s mark a moment apart (their creations are apart): the condition may name one
    # first, then both.
    ghost = eventually(
        lambda: (
            (c := groups.condition("ghost", "Unschedulable"))
            and c["status"] == "True"
            and "2 pod(s)" in c["message"]
            and c
        ),
        timeout=30,
        what="both pods no scheduler picked up reported",
    )
    assert ghost["reason"] == "NotScheduled", ghost
    assert "spec.scheduling.schedulerName 'no-such-scheduler'" in ghost["message"], ghost
    assert not any(pod.spec.node_name for pod in groups.live_pods("ghost"))
    status = groups.get("ghost")["status"]
    assert status["phase"] == "Pending"
    degraded = groups.condition("ghost", "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "NotScheduled"

    def warnings() -> list[str]:
        return [e.message for e in groups.events("ghost") if e.reason == "Unschedulable"]

    eventually(lambda: ghost["message"] in warnings(), timeout=10, what="the condition's message as an Event")
    assert all("no-such-scheduler" in m for m in warnings()), warnings()
