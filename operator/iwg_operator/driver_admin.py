"""The operator's calls to a group's driver: where it is, its admin token, and draining replicas in it.

Before the pods of a leaving replica are deleted, the driver stops sending it batches and waits for the ones in
flight (`POST /admin/replicas/<r>/drain`), so that a scale-down (the autoscaler, `kubectl scale`, an HPA) cuts
no request. The reconciler drains every replica a lower spec.replicas removes, the autoscaler before it lowers
spec.replicas; a replica whose index is kept after all is undrained.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable

import aiohttp

from iwg_operator import labels
from iwg_operator.builders.common import ADMIN_TOKEN_KEY, secret_name
from iwg_operator.kube import PODS, SECRETS, ApiError, KubeApi

DEFAULT_DRAIN_TIMEOUT_S = 60.0
# The driver's own drain endpoint waits at most this long, whatever it is asked.
DRIVER_MAX_DRAIN_S = 600.0
CONNECT_TIMEOUT_S = 5.0


class DrainError(Exception):
    """The driver could not be asked, or refused: the replicas may still have batches in flight."""


class NoReadyDriver(DrainError):
    """No driver is ready: nothing is routed to any replica, so nothing is in flight to drain."""


async def driver_address(kube: KubeApi, namespace: str, group: str) -> str | None:
    """The pod IP of the group's ready driver, if one is ready."""
    selector = labels.selector_string(labels.driver_selector(group))
    for pod in await kube.list(PODS, namespace, selector):
        pod_status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in pod_status.get("conditions") or []
        )
        if ready and pod_status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            return str(pod_status["podIP"])
    return None


async def admin_token(kube: KubeApi, namespace: str, group: str) -> str:
    secret = await kube.get(SECRETS, namespace, secret_name(group))
    data = (secret or {}).get("data") or {}
    if ADMIN_TOKEN_KEY not in data:
        raise ApiError(404, "NotFound", f"Secret {secret_name(group)} has no {ADMIN_TOKEN_KEY}")
    return base64.b64decode(data[ADMIN_TOKEN_KEY]).decode()


async def drain_replicas(
    http: aiohttp.ClientSession,
    base_url: str,
    token: str,
    replicas: Iterable[int],
    timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    undrain: bool = False,
) -> list[int]:
    """Drains each replica in the driver (no new batches; returns once its in-flight ones finished or `timeout`
    passed), or undrains it; returns the replicas the driver knew (a 404 is a replica it never saw)."""
    known = []
    action = "undrain" if undrain else f"drain?timeout={min(timeout, DRIVER_MAX_DRAIN_S):g}"
    for replica in replicas:
        url = f"{base_url}/admin/replicas/{replica}/{action}"
        async with http.post(
            url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout + 10, sock_connect=CONNECT_TIMEOUT_S),
        ) as response:
            if response.status == 404:  # the driver never saw this replica: nothing to drain
                continue
            if response.status != 200:
                raise DrainError(
                    f"{action.split('?')[0]} of replica {replica} answered HTTP {response.status}"
                )
            known.append(replica)
    return known


async def drain_group_replicas(
    kube: KubeApi,
    http: aiohttp.ClientSession,
    namespace: str,
    group: str,
    port: int,
    replicas: Iterable[int],
    timeout: float,
    undrain: bool = False,
) -> list[int]:
    """Finds the group's driver and its token, then drains (or undrains) `replicas` in it."""
    driver = await driver_address(kube, namespace, group)
    if driver is None:
        raise NoReadyDriver("no ready driver")
    token = await admin_token(kube, namespace, group)
    return await drain_replicas(http, f"http://{driver}:{port}", token, replicas, timeout, undrain)
