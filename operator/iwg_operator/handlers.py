"""Every Kopf registration of the operator, and nothing else: each handler feeds the controller.

Run with `iwg-operator` (iwg_operator.main) or `kopf run -A --standalone -m iwg_operator.handlers`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from iwg_operator import kopf_resources, labels, runtime
from iwg_operator.api import v1alpha1 as api
from iwg_operator.controller import Controller, GroupKey, group_from_body
from iwg_operator.kube import POD_GROUPS
from iwg_operator.planning import (
    ObservedDriver,
    ObservedPod,
    ObservedPodGroup,
    observe_driver_pod,
    observe_pod,
    observe_pod_group,
)
from iwg_operator.supervisor import Supervisor

kopf_resources.install()  # before Kopf starts its tasks: see kopf_resources

GROUP_RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)
WORKER_PODS = {labels.MANAGED_BY: labels.MANAGER, labels.COMPONENT: labels.COMPONENT_WORKER}
DRIVER_PODS = {labels.MANAGED_BY: labels.MANAGER, labels.COMPONENT: labels.COMPONENT_DRIVER}
POD_GROUP_RESOURCE = (POD_GROUPS.group, POD_GROUPS.version, POD_GROUPS.plural)
GANGS = {labels.MANAGED_BY: labels.MANAGER, labels.COMPONENT: labels.COMPONENT_GANG}
OWNED = {labels.MANAGED_BY: labels.MANAGER}


def _controller(memo: kopf.Memo) -> Controller:
    controller: Controller = memo["controller"]
    return controller


def _supervisor(memo: kopf.Memo) -> Supervisor:
    supervisor: Supervisor = memo["supervisor"]
    return supervisor


def _bind(controller: Controller, indices: Mapping[str, Any]) -> None:
    """Kopf passes indices by their function's name to every handler."""
    worker_pods: kopf.Index[GroupKey, ObservedPod] = indices["worker_pods"]
    gangs: kopf.Index[GroupKey, ObservedPodGroup] = indices["pod_groups"]
    drivers: kopf.Index[GroupKey, ObservedDriver] = indices["driver_pods"]

    def pods(key: GroupKey) -> Iterable[ObservedPod]:
        return list(worker_pods.get(key, ()))

    def pod_groups(key: GroupKey) -> Iterable[ObservedPodGroup]:
        return list(gangs.get(key, ()))

    def driver_pods(key: GroupKey) -> Iterable[ObservedDriver]:
        return list(drivers.get(key, ()))

    controller.bind_pod_index(pods)
    controller.bind_pod_group_index(pod_groups)
    controller.bind_driver_index(driver_pods)


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """The group as the controller keeps it: a copy without managedFields and annotations (never read), but
    for `rotate-keys`."""
    plain = copy.deepcopy({key: value for key, value in body.items() if key != "metadata"})
    metadata = body.get("metadata", {})
    plain["metadata"] = copy.deepcopy(
        {key: value for key, value in metadata.items() if key not in ("managedFields", "annotations")}
    )
    rotation = (metadata.get("annotations") or {}).get(labels.ROTATE_KEYS)
    if rotation is not None:
        plain["metadata"]["annotations"] = {labels.ROTATE_KEYS: str(rotation)}
    return plain


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return runtime.login()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    runtime.configure_kopf(settings)
    memo["controller"] = runtime.build_controller()
    # Gang placement enabled after the operator started: Kopf must watch PodGroups before any is created.
    memo["controller"].on_gang_api_served = lambda: kopf_resources.rescan(
        POD_GROUPS.group, frozenset({POD_GROUPS.plural})
    )
    memo["supervisor"] = Supervisor(memo["controller"])


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _supervisor(memo).close()
    await _controller(memo).close()


@kopf.on.probe(id="groups")
def groups_probe(memo: kopf.Memo, **_: Any) -> int:
    return len(_controller(memo).groups)


@kopf.index("pods", labels=WORKER_PODS)
async def worker_pods(body: kopf.Body, namespace: str | None, **_: Any) -> dict[GroupKey, ObservedPod] | None:
    pod = observe_pod(body)
    return None if pod is None else {(str(namespace), pod.group): pod}


@kopf.on.event("pods", labels=WORKER_PODS)
async def worker_pod_event(
    body: kopf.Body,
    namespace: str | None,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    controller = _controller(memo)
    _bind(controller, kwargs)
    controller.pods_changed(
        (str(namespace), str(body.get("metadata", {}).get("labels", {}).get(labels.GROUP)))
    )


# The drivers' pods: the DriverAvailable condition says whether one serves.
@kopf.index("pods", labels=DRIVER_PODS)
async def driver_pods(
    body: kopf.Body, namespace: str | None, **_: Any
) -> dict[GroupKey, ObservedDriver] | None:
    driver = observe_driver_pod(body)
    return None if driver is None else {(str(namespace), driver.group): driver}


@kopf.on.event("pods", labels=DRIVER_PODS)
async def driver_pod_event(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    controller = _controller(memo)
    _bind(controller, kwargs)
    controller.pods_changed(
        (str(namespace), str(body.get("metadata", {}).get("labels", {}).get(labels.GROUP)))
    )


# Gang placement: the replicas' PodGroups. Where the cluster does not serve them, Kopf resolves no resource
# for these two and watches nothing (it logs that once at startup), until the controller finds the API served
# and has Kopf discover the group again (kopf_resources.rescan).
@kopf.index(*POD_GROUP_RESOURCE, labels=GANGS)
async def pod_groups(
    body: kopf.Body, namespace: str | None, **_: Any
) -> dict[GroupKey, ObservedPodGroup] | None:
    pod_group = observe_pod_group(body)
    return None if pod_group is None else {(str(namespace), pod_group.group): pod_group}


@kopf.on.event(*POD_GROUP_RESOURCE, labels=GANGS)
async def pod_group_event(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    controller = _controller(memo)
    _bind(controller, kwargs)
    controller.pods_changed(
        (str(namespace), str(body.get("metadata", {}).get("labels", {}).get(labels.GROUP)))
    )


# The groups' other children (runtime.OWNED_KINDS, filtered by label on the server): one deleted or edited by
# hand is repaired.
@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
@kopf.on.event("", "v1", "services", labels=OWNED)
@kopf.on.event("", "v1", "configmaps", labels=OWNED)
@kopf.on.event("", "v1", "secrets", labels=OWNED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=OWNED)
async def owned_event(
    type: str | None,
    body: kopf.Body,
    namespace: str | None,
    resource: kopf.Resource,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    group = body.get("metadata", {}).get("labels", {}).get(labels.GROUP)
    if group:
        _controller(memo).child_changed(
            (str(namespace), str(group)), resource.plural, body, type == "DELETED"
        )


@kopf.on.event(*GROUP_RESOURCE)
async def group_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Every event of a group, the initial listing's included (the operator's resume). A spec is validated
    once per generation; Kopf keeps no state on the object (no annotation patches, no finalizer)."""
    controller, supervisor = _controller(memo), _supervisor(memo)
    _bind(controller, kwargs)
    key = _group_key(body)
    if type == "DELETED" or body.get("metadata", {}).get("deletionTimestamp"):
        controller.forget(key)
        supervisor.forget(key)
        return
    plain = _plain(body)
    if not controller.observe_group(plain):
        return
    try:
        group = group_from_body(plain)
    except api.ManifestError as error:
        controller.reject(plain, "; ".join(f"{path}: {text}" for path, text in error.errors))
        return
    controller.accept(plain, group)
    supervisor.watch(key)


def _group_key(body: kopf.Body) -> GroupKey:
    metadata = body.get("metadata", {})
    return str(metadata.get("namespace")), str(metadata.get("name"))
