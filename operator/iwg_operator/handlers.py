"""Every Kopf registration of the operator, and nothing else: each handler feeds the controller.

Run with `iwg-operator` (iwg_operator.main) or `kopf run -A --standalone -m iwg_operator.handlers`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from iwg_operator import labels, runtime
from iwg_operator.api import v1alpha1 as api
from iwg_operator.controller import Controller, GroupKey, group_from_body
from iwg_operator.planning import ObservedPod, observe_pod
from iwg_operator.supervisor import Supervisor

GROUP_RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)
WORKER_PODS = {labels.MANAGED_BY: labels.MANAGER, labels.COMPONENT: labels.COMPONENT_WORKER}


def _controller(memo: kopf.Memo) -> Controller:
    controller: Controller = memo["controller"]
    return controller


def _supervisor(memo: kopf.Memo) -> Supervisor:
    supervisor: Supervisor = memo["supervisor"]
    return supervisor


def _bind(controller: Controller, worker_pods: kopf.Index[GroupKey, ObservedPod]) -> None:
    def lookup(key: GroupKey) -> Iterable[ObservedPod]:
        return list(worker_pods.get(key, ()))

    controller.bind_pod_index(lookup)


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """The group as the controller keeps it: a copy without managedFields and annotations (never read)."""
    plain = copy.deepcopy({key: value for key, value in body.items() if key != "metadata"})
    metadata = body.get("metadata", {})
    plain["metadata"] = copy.deepcopy(
        {key: value for key, value in metadata.items() if key not in ("managedFields", "annotations")}
    )
    return plain


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return runtime.login()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    runtime.configure_kopf(settings)
    memo["controller"] = runtime.build_controller()
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
    _bind(controller, kwargs["worker_pods"])  # Kopf passes indices by their function's name
    controller.pods_changed(
        (str(namespace), str(body.get("metadata", {}).get("labels", {}).get(labels.GROUP)))
    )


@kopf.on.event(*GROUP_RESOURCE)
async def group_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Every event of a group, the initial listing's included (the operator's resume). A spec is validated
    once per generation; Kopf keeps no state on the object (no annotation patches, no finalizer)."""
    controller, supervisor = _controller(memo), _supervisor(memo)
    _bind(controller, kwargs["worker_pods"])
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
