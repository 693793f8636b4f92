"""Let Kopf watch an API group that the cluster starts serving after the operator started.

Kopf resolves the resources of its handlers once at startup when its CRD scanning is off (runtime.py turns it
off); a built-in API enabled later (the gang API, scheduling.k8s.io/v1beta1, after an apiserver restart with
another --runtime-config) is not a CRD, so even Kopf's scanning would not see it. `rescan(group)` does for one
group what Kopf does itself when a CRD changes (kopf._core.reactor.observation
.process_discovered_resource_event): discovery of the group, then its resources revised in Kopf's insights,
whose orchestrator then starts the watches (and indices) of the handlers that name them.

This reaches into Kopf's internals (checked against kopf 1.45.2): `install()` wraps Kopf's resource observer to
keep what it needs, and runs the rescans inside Kopf's own task, where its credentials are.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kopf._cogs.clients import scanning
from kopf._core.reactor import observation

log = logging.getLogger("iwg_operator.kopf_resources")

_requests: asyncio.Queue[tuple[str, frozenset[str], asyncio.Future[None]]] | None = None
_original_observer: Any = None


async def _observer(*, settings: Any, registry: Any, insights: Any) -> None:
    """Kopf's resource observer, and beside it the rescans asked for by `rescan`."""
    global _requests
    requests = _requests = asyncio.Queue()

    async def serve() -> None:
        await insights.ready_resources.wait()  # Kopf's own initial scan first
        while True:
            group, wanted, done = await requests.get()
            try:
                resources = await scanning.scan_resources(groups={group}, settings=settings, logger=log)
                async with insights.revised:
                    observation.revise_resources(
                        resources=resources, insights=insights, registry=registry, group=group
                    )
                    await insights.backbone.fill(resources=resources)
                    insights.revised.notify_all()
                found = {r.plural for r in resources}
                log.info("Kopf watches %s now: %s", group, sorted(found))
                if not wanted <= found:  # e.g. /apis not updated yet right after the apiserver's restart
                    raise LookupError(f"Kopf's discovery of {group} lacks {sorted(wanted - found)}")
            except Exception as error:  # the caller retries
                if not done.done():
                    done.set_exception(error)
            else:
                if not done.done():
                    done.set_result(None)

    server = asyncio.create_task(serve(), name="iwg rescans")
    try:
        await _original_observer(settings=settings, registry=registry, insights=insights)
    finally:
        server.cancel()
        _requests = None


def install() -> None:
    """Wrap Kopf's resource observer (idempotent); before Kopf starts its tasks (at import of the handlers)."""
    global _original_observer
    if not callable(getattr(observation, "resource_observer", None)):  # another Kopf: no rescans, no crash
        log.warning("this Kopf has no resource observer to wrap: an API served later needs a restart")
        return
    if _original_observer is None:
        _original_observer = observation.resource_observer
        observation.resource_observer = _observer


async def rescan(group: str, wanted: frozenset[str]) -> None:
    """Kopf discovers `group` again and watches what its handlers name there; returns once revised, or raises
    when Kopf's discovery does not show every resource (plural) in `wanted` yet (the caller tries again)."""
    if _requests is None:
        log.warning("Kopf's resource observer is not running here: %s is not rescanned", group)
        return
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    await _requests.put((group, wanted, done))
    await done
