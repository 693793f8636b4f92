"""The workers' NetworkPolicy on the real API server: egress fenced by default, accepted as built, opened in place.

The test stack enforces no NetworkPolicy (its real nodes wire pods with the bridge CNI plugin, which has no
policy engine), so this checks what the API server stores, not what packets pass; docs/operations.md says what
is fenced.
"""

from __future__ import annotations

from typing import Any

import pytest
from iwg_operator import labels
from iwg_operator.api import wiring
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster


def test_worker_egress_is_fenced_and_unrestricted_opens_it_without_rolling_pods(
    groups: Groups, operator: Any, k8s: Any
) -> None:
    networking = client.NetworkingV1Api(k8s)
    ns = groups.namespace

    def policy() -> Any:
        try:
            return networking.read_namespaced_network_policy("fence-workers", ns)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    groups.create("fence", replicas=1, worldSize=2, worker={"gpus": 0})
    pods = eventually(lambda: len(groups.pods("fence")) == 2 and groups.pods("fence"), what="2 pods")
    stored = policy()  # created before any pod
    assert stored.spec.policy_types == ["Ingress", "Egress"]
    egress = client.ApiClient().sanitize_for_serialization(stored.spec.egress)
    assert egress == [
        {"to": [{"podSelector": {"matchLabels": labels.worker_selector("fence")}}]},
        {
            "to": [{"podSelector": {"matchLabels": labels.driver_selector("fence")}}],
            "ports": [
                {"port": wiring.DEFAULT_RPC_PORT, "protocol": "TCP"},
                {"port": wiring.DEFAULT_RESPONSE_PORT, "protocol": "TCP"},
            ],
        },
        {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
    ]

    # The CRD refuses a value it does not know.
    with pytest.raises(ApiException) as refused:
        groups.patch("fence", {"worker": {"egress": "Open"}})
    assert refused.value.status == 422 and "egress" in refused.value.body

    def egress_now() -> Any:
        return client.ApiClient().sanitize_for_serialization(policy().spec.egress)

    uids = {p.metadata.uid for p in pods}
    groups.patch("fence", {"worker": {"egress": "Unrestricted"}})
    # One empty rule: any destination, any port. Not a policy without the Egress type: the rules the create
    # wrote would stay behind, inert but misleading (an apply does not remove what a create owns).
    eventually(lambda: egress_now() == [{}], what="egress opened")
    opened = policy()
    assert opened.spec.policy_types == ["Ingress", "Egress"] and opened.spec.ingress, "ingress stays fenced"

    groups.patch("fence", {"worker": {"egress": "Restricted"}})
    eventually(lambda: egress_now() == egress, what="egress fenced again")

    # A policy back in its old shape (no Egress type: as an operator before this one left it, or an edit by
    # hand) is fenced again.
    networking.patch_namespaced_network_policy(
        "fence-workers", ns, {"spec": {"policyTypes": ["Ingress"], "egress": None}}
    )
    eventually(
        lambda: policy().spec.policy_types == ["Ingress", "Egress"] and egress_now() == egress,
        what="egress fenced after an edit",
    )
    assert {p.metadata.uid for p in groups.pods("fence")} == uids, "egress is no pod's shape: nothing rolled"
    groups.delete("fence")


def test_driver_http_admits_the_groups_namespace_by_default_and_http_from_widens_it(
    groups: Groups, operator: Any, k8s: Any
) -> None:
    """The driver's HTTP port is not open to every namespace unless the spec says so (issue 30, item 11)."""
    networking = client.NetworkingV1Api(k8s)

    def http_sources() -> Any:
        try:
            stored = networking.read_namespaced_network_policy("door-driver", groups.namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        rules = client.ApiClient().sanitize_for_serialization(stored.spec.ingress)
        return [rule.get("from") for rule in rules if {"port": 8000, "protocol": "TCP"} in rule["ports"]]

    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "iwg-system"}},
        "podSelector": {"matchLabels": dict(labels.OPERATOR_POD_LABELS)},
    }
    groups.create("door", replicas=0)
    # Every rule names its sources (a rule without `from` admits any source): the pods of the group's own
    # namespace (a podSelector without namespaceSelector), and the operator's pods.
    eventually(lambda: http_sources() == [[{"podSelector": {}}], [operator_peer]], what="the driver policy")
    everywhere = {"namespaceSelector": {}}
    groups.patch("door", {"driver": {"networkPolicy": {"httpFrom": [everywhere]}}})
    eventually(lambda: http_sources() == [[everywhere], [operator_peer]], what="httpFrom applied")
    groups.delete("door")
