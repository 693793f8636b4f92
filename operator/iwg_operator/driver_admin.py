"""The operator's calls to a group's drivers: where they are, their admin token, and draining replicas in them.

Before the pods of a leaving replica are deleted, every driver stops sending it batches and waits for the ones
in flight (`POST /admin/replicas/<r>/drain`), so that a scale-down (the autoscaler, `kubectl scale`, an HPA)
cuts no request. Each driver routes its own requests (`spec.driver.replicas` > 1 runs several), so the drain
goes to every driver that runs (ready or not, terminating or not), all at once. The reconciler drains every
replica a lower spec.replicas removes or a rollout replaces, the autoscaler before it lowers spec.replicas; a
replica whose index is kept after all is undrained.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from iwg_operator import labels
from iwg_operator.builders.common import ADMIN_TOKEN_KEY, secret_name
from iwg_operator.kube import PODS, SECRETS, ApiError, KubeApi

DEFAULT_DRAIN_TIMEOUT_S = 60.0
# The driver's own drain endpoint waits at most this long, whatever it is asked.
DRIVER_MAX_DRAIN_S = 600.0
CONNECT_TIMEOUT_S = 5.0


class DrainError(Exception):
    """A driver could not be asked, or refused: the replicas may still have batches in flight there."""


class NoRunningDriver(DrainError):
    """No driver process runs: nothing is routed to any replica, so nothing is in flight to drain."""


@dataclass(frozen=True)
class DriverPod:
    """A driver pod: its name, IP, and how often its container restarted (a restarted driver process
    starts its counters from zero)."""

    name: str
    address: str
    restarts: int = 0

    @property
    def process(self) -> str:
        """Names the driver process: the pod, and which of its container's runs."""
        return f"{self.name}#{self.restarts}"


async def driver_addresses(
    kube: KubeApi, namespace: str, group: str, routing: bool = False
) -> list[DriverPod]:
    """The group's driver pods, by name (`select_drivers`)."""
    selector = labels.selector_string(labels.driver_selector(group))
    return select_drivers(await kube.list(PODS, namespace, selector), routing)


def select_drivers(pods: Iterable[Mapping[str, Any]], routing: bool = False) -> list[DriverPod]:
    """Of driver pods, by name: the ready ones that are not terminating (those the Service sends requests to,
    whose metrics count); with `routing`, every one whose container runs, ready or not, terminating or not:
    a driver that missed a readiness probe under load, or is in its lame-duck seconds after its deletion,
    still sends the requests it holds to the replicas."""
    found = []
    for pod in pods:
        pod_status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in pod_status.get("conditions") or []
        )
        containers = pod_status.get("containerStatuses") or []
        running = any("running" in (c.get("state") or {}) for c in containers)
        wanted = running if routing else ready and not pod["metadata"].get("deletionTimestamp")
        if wanted and pod_status.get("podIP"):
            restarts = sum(int(c.get("restartCount") or 0) for c in containers)
            found.append(DriverPod(pod["metadata"]["name"], str(pod_status["podIP"]), restarts))
    return sorted(found, key=lambda d: d.name)


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
) -> None:
    """Drains the replicas in one driver, all at once (no new batches to any of them; returns once their
    in-flight ones finished or `timeout` passed), or undrains them. A replica the driver never saw (404) has
    nothing to drain, nor has a driver that refuses the connection (no process listens: it routes nothing,
    starting or stopped)."""
    action = "undrain" if undrain else f"drain?timeout={min(timeout, DRIVER_MAX_DRAIN_S):g}"

    async def one(replica: int) -> None:
        try:
            await ask(replica)
        except aiohttp.ClientConnectorError as error:
            if not isinstance(error.os_error, ConnectionRefusedError):
                raise

    async def ask(replica: int) -> None:
        async with http.post(
            f"{base_url}/admin/replicas/{replica}/{action}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout + 10, sock_connect=CONNECT_TIMEOUT_S),
        ) as response:
            if response.status not in (200, 404):
                raise DrainError(
                    f"{action.split('?')[0]} of replica {replica} answered HTTP {response.status}"
                )

    await asyncio.gather(*(one(r) for r in replicas))


async def drain_in_drivers(
    http: aiohttp.ClientSession,
    drivers: Sequence[DriverPod],
    port: int,
    token: str,
    replicas: Iterable[int],
    timeout: float,
    undrain: bool = False,
) -> None:
    """Drains (or undrains) `replicas` in every driver at once, so the slowest drain bounds the wait rather
    than their sum (within a driver too: `drain_replicas`). `DrainError` names each driver pod that could not be asked or refused."""
    wanted = list(replicas)
    results = await asyncio.gather(
        *(
            drain_replicas(http, f"http://{d.address}:{port}", token, wanted, timeout, undrain)
            for d in drivers
        ),
        return_exceptions=True,
    )
    failures = []
    for driver, result in zip(drivers, results, strict=True):
        if isinstance(result, Exception):
            failures.append(f"driver pod {driver.name}: {str(result) or type(result).__name__}")
        elif isinstance(result, BaseException):
            raise result
    if failures:
        raise DrainError("; ".join(failures))


async def drain_group_replicas(
    kube: KubeApi,
    http: aiohttp.ClientSession,
    namespace: str,
    group: str,
    port: int,
    replicas: Iterable[int],
    timeout: float,
    undrain: bool = False,
) -> list[DriverPod]:
    """Finds the group's running drivers and its token, then drains (or undrains) `replicas` in every driver;
    returns the drivers asked."""
    drivers = await driver_addresses(kube, namespace, group, routing=True)
    if not drivers:
        raise NoRunningDriver("no driver runs")
    token = await admin_token(kube, namespace, group)
    await drain_in_drivers(http, drivers, port, token, replicas, timeout, undrain)
    return drivers
