"""Pure builders: the objects a group owns, derived from its spec."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pytest
import zmq
from iwg_operator import builders, labels
from iwg_operator.api import v1alpha1 as api
from iwg_operator.api import wiring
from iwg_operator.builders.workers import name_group_fields

SETTINGS = builders.BuildSettings(cluster_domain="cluster.local", operator_namespace="iwg-system")


def group(**spec: Any) -> builders.Group:
    body = {"model": {"task": "embed", "path": "/models/m"}, **spec}
    return builders.Group(name="g", namespace="ns", uid="uid-1", spec=api.parse_spec(body))


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_worker_pod_identity_and_wiring() -> None:
    pod = builders.worker_pod(group(replicas=2, worldSize=4), 1, 2, SETTINGS)
    meta = pod["metadata"]
    assert meta["name"] == "g-r1-w2"
    assert meta["labels"][labels.REPLICA] == "1" and meta["labels"][labels.RANK] == "2"
    assert meta["labels"]["app.kubernetes.io/instance"] == "g"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "iwg-operator"
    assert meta["ownerReferences"][0]["uid"] == "uid-1" and meta["ownerReferences"][0]["controller"] is True
    assert pod["spec"]["hostname"] == "g-r1-w2" and pod["spec"]["subdomain"] == "g-workers"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["iwg-worker"]
    env = env_of(container)
    assert env[wiring.MASTER_ADDR] == "g-r1-w0.g-workers.ns.svc.cluster.local"
    assert env[wiring.RANK] == env[wiring.TORCH_RANK] == "2"
    assert env[wiring.WORLD_SIZE] == env[wiring.TORCH_WORLD_SIZE] == "4"
    # One rank per pod: the first of the pod's own GPUs.
    assert env[wiring.LOCAL_RANK] == "0"
    # The drivers' headless Service: it resolves to every driver pod, and the worker links to each.
    assert env[wiring.RPC_ENDPOINT] == f"tcp://g-drivers.ns.svc.cluster.local:{wiring.DEFAULT_RPC_PORT}"
    assert env[wiring.RESPONSE_ENDPOINT].endswith(f":{wiring.DEFAULT_RESPONSE_PORT}")
    assert env[wiring.POD_IP] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[wiring.MODEL_PATH] == "/models/m" and env[wiring.SERVED_NAME] == "g"


def test_every_wiring_name_for_workers_is_written() -> None:
    names = set(env_of(builders.worker_pod(group(), 0, 0, SETTINGS)["spec"]["containers"][0]))
    expected = {
        wiring.GROUP, wiring.NAMESPACE, wiring.REPLICA, wiring.RANK, wiring.WORLD_SIZE, wiring.POD_NAME,
        wiring.POD_IP, wiring.RPC_ENDPOINT, wiring.RESPONSE_ENDPOINT, wiring.CURVE_DIR, wiring.HEALTH_PORT,
        wiring.MASTER_ADDR, wiring.MASTER_PORT, wiring.TORCH_RANK, wiring.TORCH_WORLD_SIZE, wiring.MODEL_TASK,
        wiring.MODEL_PATH, wiring.SERVED_NAME, wiring.DTYPE, wiring.ENGINE, wiring.DEVICE,
        wiring.LOCAL_RANK,
    }  # fmt: skip
    assert expected <= names


def test_gpu_resources_tolerations_and_product() -> None:
    pod = builders.worker_pod(
        group(worker={"gpus": 2, "cpu": 4, "memory": "16Gi"}, scheduling={"gpuProduct": "H100"}),
        0,
        0,
        SETTINGS,
    )
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {
        "cpu": "4",
        "memory": "16Gi",
        "ephemeral-storage": "1Gi",
        "nvidia.com/gpu": "2",
    }
    assert resources["requests"] == resources["limits"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}


def test_cpu_pod_has_no_gpu_request_or_toleration() -> None:
    pod = builders.worker_pod(group(worker={"gpus": 0}), 0, 0, SETTINGS)
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"].get("limits", {})
    assert "tolerations" not in pod["spec"]


def test_colocation_adds_required_pod_affinity_per_replica_and_keeps_users_affinity() -> None:
    user = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    pod = builders.worker_pod(
        group(worldSize=2, scheduling={"colocateRanks": True, "affinity": user}), 3, 1, SETTINGS
    )
    affinity = pod["spec"]["affinity"]
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    term = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {labels.GROUP: "g", labels.REPLICA: "3"}
    alone = builders.worker_pod(group(worldSize=2), 3, 1, SETTINGS)
    assert "affinity" not in alone["spec"]


def test_shm_probes_and_restricted_security() -> None:
    pod = builders.worker_pod(group(worker={"shmSize": "8Gi"}, health={"periodSeconds": 7}), 0, 0, SETTINGS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    container = pod["spec"]["containers"][0]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["periodSeconds"] == 7
    # A liveness kill skips the drain grace of the pod: the worker it restarts is hung.
    assert container["livenessProbe"]["terminationGracePeriodSeconds"] == 5
    assert pod["spec"]["terminationGracePeriodSeconds"] > 5
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_revision_follows_image_and_env_but_not_replicas() -> None:
    base = builders.revision(group(), SETTINGS)
    assert builders.revision(group(replicas=5), SETTINGS) == base
    assert builders.revision(group(worker={"image": "other:1"}), SETTINGS) != base
    assert builders.revision(group(worker={"env": [{"name": "A", "value": "1"}]}), SETTINGS) != base
    assert builders.revision(group(worldSize=2), SETTINGS) != base


def test_driver_deployment_and_service() -> None:
    g = group(driver={"port": 9000, "batching": {"maxBatchSize": 8, "maxQueue": 64}})
    deployment = builders.driver_deployment(g)
    # A single driver surges too: a new pod Ready before the old one stops, never Recreate (a window of refusals).
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["iwg-driver"]
    env = env_of(container)
    assert (
        env[wiring.HTTP_PORT] == "9000"
        and env[wiring.MAX_BATCH_SIZE] == "8"
        and env[wiring.MAX_QUEUE] == "64"
    )
    assert env[wiring.RPC_ENDPOINT] == f"tcp://$({wiring.POD_IP}):{wiring.DEFAULT_RPC_PORT}"
    service = builders.driver_service(g)
    assert service["metadata"]["name"] == "g-driver"
    # Clients' HTTP only: workers reach the drivers through the drivers' headless Service.
    assert {p["port"] for p in service["spec"]["ports"]} == {9000}
    drivers = builders.drivers_service(g)
    assert {p["port"] for p in drivers["spec"]["ports"]} == {
        wiring.DEFAULT_RPC_PORT,
        wiring.DEFAULT_RESPONSE_PORT,
    }
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert all(deployment["spec"]["template"]["metadata"]["labels"][k] == v for k, v in selector.items())


def test_several_drivers_roll_one_at_a_time_behind_a_budget_and_a_headless_service() -> None:
    one = group()
    assert builders.driver_disruption_budget(one)["spec"]["minAvailable"] == 0  # a lone driver never blocks
    three = group(driver={"replicas": 3})
    deployment = builders.driver_deployment(three)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    selector = deployment["spec"]["selector"]["matchLabels"]
    pdb = builders.driver_disruption_budget(three)
    assert (pdb["metadata"]["name"], pdb["spec"]) == (
        "g-driver",
        {"minAvailable": 1, "selector": {"matchLabels": selector}},
    )
    drivers = builders.drivers_service(three)
    assert drivers["metadata"]["name"] == "g-drivers"
    assert drivers["spec"]["clusterIP"] == "None" and drivers["spec"]["publishNotReadyAddresses"] is True
    assert drivers["spec"]["selector"] == selector
    assert {p["port"] for p in drivers["spec"]["ports"]} == {
        wiring.DEFAULT_RPC_PORT,
        wiring.DEFAULT_RESPONSE_PORT,
    }
    # The worker PDB and the drivers' do not select each other's pods.
    assert builders.pod_disruption_budget(three)["spec"]["selector"]["matchLabels"] != selector


def test_a_driver_pod_has_the_time_to_finish_what_it_admitted_before_it_is_killed() -> None:
    pod = builders.driver_deployment(group())["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    assert (
        grace > wiring.DEFAULT_DRIVER_LAME_DUCK_S + wiring.DRIVER_DRAIN_S > 30
    )  # Kubernetes' default would cut it
    assert env_of(pod["containers"][0])[wiring.DRIVER_LAME_DUCK] == "5"


def test_a_worker_pod_has_the_time_to_drain_its_generation_requests_before_it_is_killed() -> None:
    grace = builders.worker_pod(group(), 0, 0, SETTINGS)["spec"]["terminationGracePeriodSeconds"]
    assert grace == wiring.WORKER_DRAIN_S + wiring.WORKER_GRACE_AFTER_DRAIN_S  # the drain, then the stop
    assert grace >= wiring.WORKER_DRAIN_S + 10


def test_the_lame_duck_time_is_settable_and_the_grace_period_covers_it() -> None:
    pod = builders.driver_deployment(group(driver={"lameDuckSeconds": 20}))["spec"]["template"]["spec"]
    assert env_of(pod["containers"][0])[wiring.DRIVER_LAME_DUCK] == "20"
    assert pod["terminationGracePeriodSeconds"] == 20 + wiring.DRIVER_DRAIN_S + 5
    with pytest.raises(api.ManifestError, match=r"driver\.lameDuckSeconds"):
        group(driver={"lameDuckSeconds": -1})


def test_driver_replicas_are_bounded() -> None:
    for bad in (0, api.MAX_DRIVER_REPLICAS + 1):
        with pytest.raises(api.ManifestError, match=r"driver\.replicas"):
            group(driver={"replicas": bad})


def test_headless_service_selects_workers_before_ready() -> None:
    service = builders.headless_service(group())
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = builders.worker_pod(group(), 0, 0, SETTINGS)["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in service["spec"]["selector"].items())


def test_curve_secret_holds_two_keypairs_and_each_pod_mounts_its_side_only() -> None:
    driver, worker = zmq.curve_keypair(), zmq.curve_keypair()
    manifest = builders.curve_secret(group(), driver, worker, "token", rotation="2026-12-04")
    assert manifest["immutable"] is True
    assert manifest["metadata"]["annotations"] == {labels.ROTATE_KEYS: "2026-12-04"}
    assert builders.secret_is_current(manifest, "2026-12-04") and not builders.secret_is_current(manifest, "")
    data = {key: base64.b64decode(value) for key, value in manifest["data"].items()}
    assert (data["driver.pub"], data["driver.key"]) == driver and (
        data["worker.pub"],
        data["worker.key"],
    ) == worker
    # The one-keypair form of earlier versions is not current: the operator replaces it.
    old = {"metadata": {}, "data": {"curve.pub": "x", "curve.key": "y", "admin.token": "z"}}
    assert not builders.secret_is_current(old, "")

    keyed = dataclasses.replace(group(), keys=builders.keys_digest(manifest["data"]))
    pod = builders.worker_pod(keyed, 0, 0, SETTINGS)
    driver_pod = builders.driver_deployment(keyed)["spec"]["template"]
    mounted = {}
    for name, template in (("worker", pod), ("driver", driver_pod)):
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "curve"]
        mounted[name] = {item["key"]: item["path"] for item in volume["secret"]["items"]}
        assert template["metadata"]["annotations"][labels.KEYS] == keyed.keys
    assert mounted["worker"] == {
        "worker.key": wiring.CURVE_SECRET_FILE,
        "worker.pub": wiring.CURVE_PUBLIC_FILE,
        "driver.pub": wiring.CURVE_PEER_FILE,
    }
    assert mounted["driver"] == {
        "driver.key": wiring.CURVE_SECRET_FILE,
        "driver.pub": wiring.CURVE_PUBLIC_FILE,
        "worker.pub": wiring.CURVE_PEER_FILE,
        "admin.token": "admin.token",
    }
    # Other keys, another revision: the pods roll.
    assert builders.revision(keyed, SETTINGS) != builders.revision(group(), SETTINGS)


def test_network_policy_admits_group_and_operator_only() -> None:
    policy = builders.network_policy(group(), SETTINGS)["spec"]
    assert policy["podSelector"]["matchLabels"] == labels.worker_selector("g")
    peers = [peer for rule in policy["ingress"] for peer in rule["from"]]
    assert {"podSelector": {"matchLabels": {labels.GROUP: "g"}}} in peers
    operator = next(p for p in peers if "namespaceSelector" in p)
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "iwg-system"}
    assert all("ipBlock" not in p for p in peers)


def test_network_policy_fences_worker_egress_to_group_drivers_and_dns() -> None:
    policy = builders.network_policy(group(), SETTINGS)["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    workers = {"podSelector": {"matchLabels": labels.worker_selector("g")}}
    drivers = {"podSelector": {"matchLabels": labels.driver_selector("g")}}
    dns = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert policy["egress"] == [
        {"to": [workers]},  # any port: collectives listen on ports chosen at run time
        {
            "to": [drivers],
            "ports": [
                {"port": wiring.DEFAULT_RPC_PORT, "protocol": "TCP"},
                {"port": wiring.DEFAULT_RESPONSE_PORT, "protocol": "TCP"},
            ],
        },
        {"ports": dns},  # any address: NodeLocal DNSCache and DNS pods labelled otherwise
    ]
    # Nothing else: no ipBlock, no namespaceSelector (the group's own namespace only), no empty rule.
    peers = [peer for rule in policy["egress"] for peer in rule.get("to", [])]
    assert all(set(peer) == {"podSelector"} for peer in peers)
    assert all(rule.get("to") or rule.get("ports") for rule in policy["egress"])


def test_unrestricted_worker_egress_leaves_egress_open_and_rolls_no_pod() -> None:
    restricted, unrestricted = group(), group(worker={"egress": "Unrestricted"})
    policy = builders.network_policy(unrestricted, SETTINGS)["spec"]
    # One empty rule admits every destination and port (Kubernetes' own "allow all egress" policy).
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == [{}]
    assert policy["ingress"] == builders.network_policy(restricted, SETTINGS)["spec"]["ingress"]
    assert builders.revision(unrestricted, SETTINGS) == builders.revision(restricted, SETTINGS)


def _rules_by_port(policy: dict[str, Any]) -> dict[int, list[dict[str, Any]] | None]:
    """Sources admitted per port: None for any source."""
    result: dict[int, list[dict[str, Any]] | None] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            if "from" not in rule or result.get(port["port"], []) is None:
                result[port["port"]] = None
            else:
                result.setdefault(port["port"], []).extend(rule["from"])  # type: ignore[union-attr]
    return result


def test_driver_network_policy_admits_http_from_its_namespace_and_zmq_from_the_groups_workers() -> None:
    manifest = builders.driver_network_policy(group(driver={"port": 9000}), SETTINGS)
    assert manifest["metadata"]["name"] == "g-driver"
    policy = manifest["spec"]
    assert policy["podSelector"]["matchLabels"] == labels.driver_selector("g")
    assert policy["policyTypes"] == ["Ingress"]
    workers = [{"podSelector": {"matchLabels": labels.worker_selector("g")}}]
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "iwg-system"}},
        "podSelector": {"matchLabels": labels.OPERATOR_POD_LABELS},
    }
    assert _rules_by_port(policy) == {
        9000: [{"podSelector": {}}, operator],  # the pods of the group's own namespace, and the operator
        wiring.DEFAULT_RPC_PORT: workers,
        wiring.DEFAULT_RESPONSE_PORT: workers,
    }


def test_driver_network_policy_http_from_admits_those_peers_and_the_operator_only() -> None:
    clients = {"namespaceSelector": {"matchLabels": {"team": "web"}}}
    office = {"ipBlock": {"cidr": "10.1.0.0/16", "except": ["10.1.2.0/24"]}}
    g = group(driver={"networkPolicy": {"httpFrom": [clients, office]}})
    by_port = _rules_by_port(builders.driver_network_policy(g, SETTINGS)["spec"])
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "iwg-system"}},
        "podSelector": {"matchLabels": labels.OPERATOR_POD_LABELS},
    }
    assert by_port[8000] == [clients, office, operator]
    assert set(by_port) == {8000, wiring.DEFAULT_RPC_PORT, wiring.DEFAULT_RESPONSE_PORT}


def test_driver_has_cpu_and_memory_requests_and_limits_by_default() -> None:
    container = builders.driver_deployment(group())["spec"]["template"]["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]
    assert resources["limits"] == {
        "cpu": api.DEFAULT_DRIVER_CPU,
        "memory": api.DEFAULT_DRIVER_MEMORY,
        "ephemeral-storage": api.DEFAULT_DRIVER_TMP_SIZE,
    }
    assert (api.DEFAULT_DRIVER_CPU, api.DEFAULT_DRIVER_MEMORY) == ("1", "1Gi")
    given = builders.driver_deployment(group(driver={"cpu": "250m", "memory": "512Mi"}))
    limits = given["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["cpu"], limits["memory"]) == ("250m", "512Mi")


def _tmp(pod_spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The /tmp volume and the container's resources."""
    container = pod_spec["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
    return volume, container["resources"]


def test_tmp_of_workers_and_driver_is_bounded_and_configurable() -> None:
    defaults = group()
    sized = group(worker={"tmpSize": "3Gi"}, driver={"tmpSize": "100Mi"})
    for g, worker_size, driver_size in ((defaults, "1Gi", "256Mi"), (sized, "3Gi", "100Mi")):
        pods = [
            (builders.worker_pod(g, 0, 0, SETTINGS)["spec"], worker_size),
            (builders.driver_deployment(g)["spec"]["template"]["spec"], driver_size),
        ]
        for pod_spec, size in pods:
            volume, resources = _tmp(pod_spec)
            assert volume["emptyDir"] == {"sizeLimit": size}
            assert resources["requests"]["ephemeral-storage"] == size
            assert resources["limits"]["ephemeral-storage"] == size
    assert builders.revision(sized, SETTINGS) != builders.revision(defaults, SETTINGS)


def test_pdb_and_config_map() -> None:
    # Pods that must stay: all but maxUnavailable (an evicted rank takes its replica down, so maxUnavailable
    # replicas are maxUnavailable pods), never a maxUnavailable (which the disruption controller would weigh
    # against the scale subresource's replicas, not pods).
    pdb = builders.pod_disruption_budget(group(replicas=3, worldSize=4, rollout={"maxUnavailable": 2}))
    assert pdb["spec"]["minAvailable"] == 10 and "maxUnavailable" not in pdb["spec"]
    pdb = builders.pod_disruption_budget(group(replicas=3, rollout={"maxUnavailable": 1}))
    assert pdb["spec"]["minAvailable"] == 2  # worldSize 1: replicas - maxUnavailable, as before
    pdb = builders.pod_disruption_budget(group(replicas=2, worldSize=3, rollout={"maxUnavailable": 2}))
    assert pdb["spec"]["minAvailable"] == 0  # every replica may go: every pod may
    pdb = builders.pod_disruption_budget(group(replicas=1, rollout={"maxUnavailable": 1}))
    assert pdb["spec"]["minAvailable"] == 0  # one replica: its node's drain is never blocked
    config = builders.config_map(group(replicas=3), SETTINGS)
    assert '"replicas": 3' in config["data"]["group.json"]


def test_spec_hash_changes_with_content_only() -> None:
    a = builders.driver_service(group())
    b = builders.driver_service(group())
    c = builders.driver_service(group(driver={"port": 9001}))
    key = labels.SPEC_HASH
    assert a["metadata"]["annotations"][key] == b["metadata"]["annotations"][key]
    assert a["metadata"]["annotations"][key] != c["metadata"]["annotations"][key]


def test_scaling_never_changes_the_driver_pod_template() -> None:
    template = builders.driver_deployment(group(replicas=2))["spec"]["template"]
    for scaled in (group(replicas=7), group(replicas=2, autoscaling={"enabled": True, "maxReplicas": 12})):
        assert builders.driver_deployment(scaled)["spec"]["template"] == template
    env = env_of(template["spec"]["containers"][0])
    assert env[wiring.REPLICAS] == str(api.MAX_REPLICAS)


def test_refusals_of_a_worker_pod_name_the_groups_fields() -> None:
    refusal = (
        'Pod "g-r0-w0" is invalid: [spec.tolerations[1].key: Invalid value: "a b", '
        'spec.containers[0].resources.limits[memory]: Invalid value: "1", spec.containers[0].image: Required '
        "value, spec.nodeSelector: Invalid value: \"x y\", spec.containers[0].env[3].name: Invalid value: ''"
    )
    named = name_group_fields(refusal)
    assert "spec.scheduling.tolerations[1].key" in named
    assert "spec.worker.memory" in named and "spec.worker.image" in named
    assert "spec.scheduling.nodeSelector" in named
    assert "spec.containers[0].env[3].name" in named  # the operator's own fields keep the pod's names


def test_gang_defaults_on_for_more_than_one_rank_and_follows_the_spec() -> None:
    assert not group(worldSize=1).spec.gang_enabled
    assert group(worldSize=2).spec.gang_enabled
    assert not group(worldSize=4, scheduling={"gang": False}).spec.gang_enabled
    assert group(worldSize=1, scheduling={"gang": True}).spec.gang_enabled
    # Turning it on or off reshapes the pods (they name a PodGroup or not): a rollout.
    assert builders.revision(group(worldSize=2), SETTINGS) != builders.revision(
        group(worldSize=2, scheduling={"gang": False}), SETTINGS
    )


def test_workload_and_podgroup_follow_the_v1beta1_fields_and_are_owned_by_the_group() -> None:
    g = group(replicas=2, worldSize=4)
    workload = builders.workload(g)
    assert workload["apiVersion"] == "scheduling.k8s.io/v1beta1" and workload["kind"] == "Workload"
    assert workload["metadata"]["name"] == "g"
    assert workload["spec"]["podGroupTemplates"] == [
        {"name": "workers", "schedulingPolicy": {"gang": {"minCount": 4}}}
    ]
    assert workload["spec"]["controllerRef"] == {
        "apiGroup": api.GROUP,
        "kind": api.KIND,
        "name": "g",
    }
    pod_group = builders.pod_group(g, 1)
    assert pod_group["kind"] == "PodGroup" and pod_group["metadata"]["name"] == "g-r1"
    assert pod_group["metadata"]["labels"][labels.REPLICA] == "1"
    assert pod_group["metadata"]["labels"][labels.COMPONENT] == labels.COMPONENT_GANG
    assert pod_group["spec"] == {
        "workloadRef": {"workloadName": "g", "templateName": "workers"},
        "schedulingPolicy": {"gang": {"minCount": 4}},
    }
    for manifest in (workload, pod_group):
        owner = manifest["metadata"]["ownerReferences"][0]
        assert owner["uid"] == "uid-1" and owner["controller"] is True


def test_the_gang_carries_the_workers_priority_class_on_its_template_and_podgroup() -> None:
    """The scheduler takes a gang's priority from its PodGroup and refuses a gang whose pods' priority differs
    (v1.37 validatePodGroup): the class goes wherever the v1beta1 API takes it."""
    g = group(replicas=2, worldSize=4, scheduling={"priorityClassName": "inference-high"})
    template = builders.workload(g)["spec"]["podGroupTemplates"][0]
    assert template["priorityClassName"] == "inference-high"
    assert builders.pod_group(g, 0)["spec"]["priorityClassName"] == "inference-high"
    pod = builders.worker_pod(g, 0, 0, SETTINGS, builders.pod_group_name("g", 0))
    assert pod["spec"]["priorityClassName"] == "inference-high"
    # Without one, neither says anything (admission gives the global default, or 0, to pods and group alike).
    plain = group(replicas=2, worldSize=4)
    assert "priorityClassName" not in builders.workload(plain)["spec"]["podGroupTemplates"][0]
    assert "priorityClassName" not in builders.pod_group(plain, 0)["spec"]
    # The class is part of the Workload's hash: its templates are immutable, so a change replaces it.
    assert (
        builders.workload(g)["metadata"]["annotations"] != builders.workload(plain)["metadata"]["annotations"]
    )


def test_a_gang_pod_names_its_podgroup_and_others_do_not() -> None:
    g = group(replicas=2, worldSize=2)
    pod = builders.worker_pod(g, 1, 0, SETTINGS, builders.pod_group_name("g", 1))
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "g-r1"}
    assert "schedulingGroup" not in builders.worker_pod(g, 1, 0, SETTINGS)["spec"]


def test_the_pods_own_mounts_are_the_ones_admission_keeps_model_volumes_off() -> None:
    g = group(model={"task": "embed", "path": "/models/m", "volume": {"claimName": "c"}})
    worker = builders.worker_pod(g, 0, 0, SETTINGS)["spec"]["containers"][0]
    driver = builders.driver_deployment(g)["spec"]["template"]["spec"]["containers"][0]
    own = {m["mountPath"] for c in (worker, driver) for m in c["volumeMounts"] if m["name"] != "model"}
    assert own == set(api.POD_MOUNT_PATHS)


def test_kv_cache_size_reaches_the_workers_and_takes_one_form() -> None:
    def worker_env(**kv: Any) -> dict[str, Any]:
        spec = group(model={"task": "generate", "path": "/models/lm", "kvCache": kv})
        return env_of(builders.worker_pod(spec, 0, 0, SETTINGS)["spec"]["containers"][0])

    assert worker_env(blocks=512)[wiring.KV_CACHE_BLOCKS] == "512"
    assert wiring.KV_CACHE_MEMORY_FRACTION not in worker_env(blocks=512)
    assert worker_env(memoryFraction=0.5)[wiring.KV_CACHE_MEMORY_FRACTION] == "0.5"
    unset = env_of(builders.worker_pod(group(), 0, 0, SETTINGS)["spec"]["containers"][0])
    assert wiring.KV_CACHE_BLOCKS not in unset and wiring.KV_CACHE_MEMORY_FRACTION not in unset
    with pytest.raises(Exception, match="blocks or memoryFraction, not both"):
        worker_env(blocks=512, memoryFraction=0.5)


def test_the_engine_choice_reaches_the_workers_and_rolls_them_but_not_the_driver() -> None:
    def generate(**model: Any) -> builders.Group:
        return group(model={"task": "generate", "path": "/models/lm", **model})

    def engine_env(g: builders.Group) -> Any:
        return env_of(builders.worker_pod(g, 0, 0, SETTINGS)["spec"]["containers"][0])[wiring.ENGINE]

    for engine in ("auto", "vllm", "transformers"):
        assert engine_env(generate(engine=engine)) == engine
    assert engine_env(generate()) == "auto"
    assert builders.revision(generate(engine="vllm"), SETTINGS) != builders.revision(generate(), SETTINGS)
    # The driver does not read it: a changed engine replaces the workers, not the driver.
    driver = builders.driver_deployment(generate(engine="vllm"))["spec"]["template"]
    assert driver == builders.driver_deployment(generate())["spec"]["template"]
    assert wiring.ENGINE not in env_of(driver["spec"]["containers"][0])


def test_enforce_eager_reaches_the_workers_only_when_set_and_rolls_them_but_not_the_driver() -> None:
    def generate(**model: Any) -> builders.Group:
        return group(model={"task": "generate", "path": "/models/lm", **model})

    def worker_env_of(g: builders.Group) -> dict[str, Any]:
        return env_of(builders.worker_pod(g, 0, 0, SETTINGS)["spec"]["containers"][0])

    assert worker_env_of(generate(enforceEager=True))[wiring.ENFORCE_EAGER] == "1"
    assert worker_env_of(generate(engine="vllm", enforceEager=True))[wiring.ENFORCE_EAGER] == "1"
    # Unset (or false) leaves the variable out, as iwg serve's workers see it: vLLM compiles.
    assert wiring.ENFORCE_EAGER not in worker_env_of(generate())
    assert wiring.ENFORCE_EAGER not in worker_env_of(generate(enforceEager=False))
    eager = generate(enforceEager=True)
    assert builders.revision(eager, SETTINGS) != builders.revision(generate(), SETTINGS)
    assert builders.revision(generate(enforceEager=False), SETTINGS) == builders.revision(
        generate(), SETTINGS
    )
    driver = builders.driver_deployment(eager)["spec"]["template"]
    assert driver == builders.driver_deployment(generate())["spec"]["template"]
    assert wiring.ENFORCE_EAGER not in env_of(driver["spec"]["containers"][0])


def test_a_chat_template_reaches_the_workers_and_rolls_them_but_not_the_driver() -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def generate(**model: Any) -> builders.Group:
        return group(model={"task": "generate", "path": "/models/lm", **model})

    def worker_env_of(g: builders.Group) -> dict[str, Any]:
        return env_of(builders.worker_pod(g, 0, 0, SETTINGS)["spec"]["containers"][0])

    templated = generate(chatTemplate=template)
    assert worker_env_of(templated)[wiring.CHAT_TEMPLATE] == template
    assert wiring.CHAT_TEMPLATE not in worker_env_of(generate())
    assert builders.revision(templated, SETTINGS) != builders.revision(generate(), SETTINGS)
    driver = builders.driver_deployment(templated)["spec"]["template"]
    assert driver == builders.driver_deployment(generate())["spec"]["template"]
