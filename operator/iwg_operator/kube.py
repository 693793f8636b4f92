"""A small async Kubernetes API client (aiohttp) for the operator's own reads and writes.

It speaks only the verbs the operator needs (get, create, apply, patch, update, delete) on the resources it owns,
and counts every request by verb, resource and status code (`RequestCounter`, also exported as
`iwg_operator_api_requests_total` through iwg_operator.metrics). Watching is Kopf's job, not this client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import aiohttp

from iwg_operator import metrics
from iwg_operator.api import v1alpha1 as api
from iwg_operator.credentials import Credentials, TokenSource

FIELD_MANAGER = "iwg-operator"
# Requests in flight to the API server at once, all groups together (the rest wait in priority order). At 250
# groups on the 2-core bench, 1000 pods existed after 20 s with 8, 15-19 s with 16, 14-15 s with 32 and 7-11 s
# with 64: 32 keeps most of the gain without one operator holding a large share of the API server's seats.
MAX_IN_FLIGHT = 32

WRITE_VERBS = frozenset({"create", "apply", "patch", "update", "delete"})


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


PODS = Resource("", "v1", "pods", "Pod")
SERVICES = Resource("", "v1", "services", "Service")
CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap")
SECRETS = Resource("", "v1", "secrets", "Secret")
EVENTS = Resource("", "v1", "events", "Event")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
POD_DISRUPTION_BUDGETS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
GROUPS = Resource(api.GROUP, api.VERSION, api.PLURAL, api.KIND)
WORKLOADS = Resource("scheduling.k8s.io", "v1beta1", "workloads", "Workload")
POD_GROUPS = Resource("scheduling.k8s.io", "v1beta1", "podgroups", "PodGroup")
# The leader election's Lease (iwg_operator.leader), in the operator's own namespace: get, create, update.
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")

# Every resource the reconciler touches, with its verbs: the Helm chart's RBAC is built from this list
# (plus Kopf's own needs: watch/list/patch on groups, watch/list on pods, create events, list CRDs).
RESOURCE_VERBS: dict[Resource, tuple[str, ...]] = {
    PODS: ("create", "delete", "list"),  # list: the autoscaler finds the driver pod
    # The children: watched by Kopf (list, watch) so that one deleted or edited by hand is repaired.
    SERVICES: ("get", "list", "watch", "create", "patch"),
    CONFIG_MAPS: ("get", "list", "watch", "create", "patch"),
    # delete: new keys (rotate-keys, or the one-keypair form of earlier versions) replace the immutable Secret
    SECRETS: ("get", "list", "watch", "create", "delete"),
    EVENTS: ("create",),
    DEPLOYMENTS: ("get", "list", "watch", "create", "patch"),
    NETWORK_POLICIES: ("get", "list", "watch", "create", "patch"),
    POD_DISRUPTION_BUDGETS: ("get", "list", "watch", "create", "patch"),
    # patch: the status and scale subresources (the autoscaler sets replicas through scale); list: a status
    # write refused as stale (409) reads the group again, by name (Kopf's watch needs list anyway)
    GROUPS: ("list", "patch"),
    # Gang placement, where the cluster serves it: a Workload per group (replaced when the world size changes:
    # its templates are fixed), a PodGroup per replica (read from a Kopf index, never fetched one by one).
    WORKLOADS: ("get", "create", "delete"),
    POD_GROUPS: ("create", "delete"),
    # The leader election (iwg_operator.leader): one Lease in the operator's own namespace, not the groups'.
    LEASES: ("get", "create", "update"),
}


class Priority(IntEnum):
    """Which requests go first when more wait than may be in flight (lower first).

    Pods are the critical path of a group (scheduling, image pull, model load). What must exist before a pod
    goes first: the Secret it mounts, the NetworkPolicy that fences it (a pod is never reachable from the
    cluster before its policy exists) and, with gang placement, its Workload and PodGroup. The status (what users and tools watch) follows the pods, and Events
    and the objects no pod needs to start (driver, Services, PDB, ConfigMap) come last.
    """

    BEFORE_PODS = 0
    PODS = 1
    STATUS = 2
    SUPPORT = 3


PRIORITIES: dict[Resource, Priority] = {
    SECRETS: Priority.BEFORE_PODS,
    NETWORK_POLICIES: Priority.BEFORE_PODS,
    WORKLOADS: Priority.BEFORE_PODS,
    POD_GROUPS: Priority.BEFORE_PODS,
    PODS: Priority.PODS,
    GROUPS: Priority.STATUS,
}


class RequestScheduler:
    """At most `limit` requests in flight; the waiting ones start in priority order, first come first within one.

    Hundreds of groups reconciling at once would otherwise put their requests to the API server in whatever
    order the event loop runs them, and a supporting object of one group would delay the pods of another.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrival = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        if self.in_flight < self.limit and not self._waiting:
            self.in_flight += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._arrival), turn))
            try:
                await turn  # a finishing request hands its slot over (in_flight stays counted)
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._release()  # handed a slot in the same moment as cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # a cancelled waiter is skipped
                turn.set_result(None)
                return
        self.in_flight -= 1


class ApiError(Exception):
    """A refusal by the API server: status code, reason, the server's message and its causes' types."""

    def __init__(self, status: int, reason: str, message: str, causes: tuple[str, ...] = ()) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes
        super().__init__(f"{status} {reason}: {message}")

    @property
    def refusal(self) -> bool:
        """A client error that asking again will not change (unlike a throttle or a namespace closing)."""
        return 400 <= self.status < 500 and self.status != 429 and not self.namespace_terminating

    @property
    def namespace_terminating(self) -> bool:
        """Nothing can be created in the namespace any more: it is being deleted, with everything in it."""
        return NAMESPACE_TERMINATING in self.causes


NAMESPACE_TERMINATING = "NamespaceTerminating"  # the cause the NamespaceLifecycle admission plugin gives


class RequestCounter:
    """Counts requests by (verb, resource, status code)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, int]] = Counter()

    def add(self, verb: str, resource: str, code: int) -> None:
        self.counts[(verb, resource, code)] += 1
        metrics.api_request(verb, resource, code)

    def total(self) -> int:
        return sum(self.counts.values())

    def writes(self) -> int:
        return sum(n for (verb, _, _), n in self.counts.items() if verb in WRITE_VERBS)


@dataclass(frozen=True)
class Connection:
    server: str
    ssl_context: ssl.SSLContext | bool
    tokens: TokenSource | None = None  # the bearer token, kept current (re-read, re-issued on expiry or 401)

    @classmethod
    def from_credentials(cls, credentials: Credentials) -> Connection:
        context = ssl.create_default_context(cafile=credentials.ca_file)
        if not credentials.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if credentials.cert_file:
            context.load_cert_chain(credentials.cert_file, credentials.key_file)
        tokens = TokenSource(credentials)
        return cls(
            server=credentials.server,
            ssl_context=context,
            tokens=tokens if tokens.current or tokens.renewable else None,
        )

    @classmethod
    def from_environment(cls) -> Connection:
        return cls.from_credentials(Credentials.from_environment())


class KubeApi:
    """Async access to the operator's resources; every request is counted."""

    def __init__(
        self,
        connection: Connection,
        max_connections: int = 64,
        timeout: float = 30.0,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.connection = connection
        self.requests = RequestCounter()
        self.scheduler = RequestScheduler(max_in_flight)
        # Per-socket limits, not a total: under load a request may wait for a pooled connection a while.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._discovered: dict[str, asyncio.Future[frozenset[str]]] = {}
        self._discovered_at: dict[str, float] = {}  # when each lookup was asked (time.monotonic)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json", "User-Agent": "iwg-operator"}
            self._session = aiohttp.ClientSession(
                base_url=self.connection.server,
                headers=headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=self.connection.ssl_context, limit=self._max_connections),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        verb: str,
        method: str,
        resource: Resource,
        path: str,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        async with self.scheduler.slot(PRIORITIES.get(resource, Priority.SUPPORT)):
            # Serialized only when its turn comes: hundreds of waiting requests hold no second copy.
            data = json.dumps(body) if body is not None else None
            headers = {"Content-Type": content_type} if data is not None else {}
            code, text = await self._send(verb, resource.plural, method, path, data, headers, params)
            if code >= 400:
                raise api_error(code, text)
            result: dict[str, Any] = json.loads(text) if text else {}
            return result

    async def _send(
        self,
        verb: str,
        counted_as: str,
        method: str,
        path: str,
        data: str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        """One request with the current token; a 401 renews the token (the file read again, the exec plugin
        run again) and, when that gave another token, the request is sent once more with it."""
        tokens = self.connection.tokens
        token = await self._token()
        for attempt in range(2):
            sent = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
            async with self._client().request(
                method, path, data=data, headers=sent, params=params
            ) as response:
                self.requests.add(verb, counted_as, response.status)
                text = await response.text()
            if response.status != 401 or attempt or tokens is None or not tokens.renewable:
                break
            renewed = await asyncio.to_thread(tokens.renew, token)
            if renewed == token:
                break
            token = renewed
        return response.status, text

    async def _token(self) -> str | None:
        tokens = self.connection.tokens
        if tokens is None:
            return None
        if tokens.due():  # reading the file or running the exec plugin: off the event loop
            return await asyncio.to_thread(tokens.token)
        return tokens.current

    async def served(self, resource: Resource, recheck_after: float | None = None) -> bool:
        """Whether the API server serves the resource (a 404 means not served: an older cluster or a feature
        gate off). Discovery of its group version is asked once and cached: a resource served, for the life of
        the client; one not served, for `recheck_after` seconds (None: for the life of the client too), so
        that an API a cluster enables later is found without a restart."""
        key = resource.api_version
        lookup = self._discovered.get(key)
        if (
            lookup is not None
            and recheck_after is not None
            and lookup.done()
            and not lookup.cancelled()
            and lookup.exception() is None
            and resource.plural not in lookup.result()
            and time.monotonic() - self._discovered_at.get(key, 0.0) >= recheck_after
        ):
            lookup = None
        if lookup is None:
            lookup = self._discovered[key] = asyncio.ensure_future(self._discover(resource))
            self._discovered_at[key] = time.monotonic()
        try:
            plurals = await asyncio.shield(lookup)
        except Exception:
            if self._discovered.get(key) is lookup:
                del self._discovered[key]  # a failed lookup (not a 404) is asked again next time
            raise
        return resource.plural in plurals

    async def _discover(self, resource: Resource) -> frozenset[str]:
        path = f"/apis/{resource.api_version}" if resource.group else f"/api/{resource.version}"
        code, text = await self._send("discover", resource.api_version, "GET", path)
        if code == 404:
            return frozenset()
        if code >= 400:
            raise api_error(code, text)
        found = json.loads(text).get("resources") or []
        return frozenset(str(r.get("name")) for r in found if isinstance(r, dict))

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("get", "GET", resource, resource.path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def create(self, resource: Resource, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("create", "POST", resource, resource.path(namespace), body)

    async def apply(
        self, resource: Resource, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Server-side apply of the operator's desired fields (the operator's field manager wins conflicts)."""
        return await self._request(
            "apply",
            "PATCH",
            resource,
            resource.path(namespace, name),
            body,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    async def patch_status(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """A merge patch of the status; with `resource_version`, refused (409 Conflict) unless the object is
        still at that version (optimistic concurrency: the patch was computed from that read)."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.patch(resource, namespace, name, body, "status")

    async def list(
        self, resource: Resource, namespace: str, label_selector: str, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The objects matching a label selector (the autoscaler finds the driver pod with it) and, if given, a
        field selector (`metadata.name=NAME`: one object read with the right to list)."""
        params = {"labelSelector": label_selector}
        if field_selector is not None:
            params["fieldSelector"] = field_selector
        result = await self._request("list", "GET", resource, resource.path(namespace), params=params)
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch, of the object or of one of its subresources."""
        return await self._request(
            "patch",
            "PATCH",
            resource,
            resource.path(namespace, name, subresource),
            body,
            content_type="application/merge-patch+json",
        )

    async def replace(
        self, resource: Resource, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A PUT (verb update): with metadata.resourceVersion set, refused (409) when the object changed since."""
        return await self._request("update", "PUT", resource, resource.path(namespace, name), body)

    async def scale(self, resource: Resource, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set replicas through the scale subresource: the right to scale, not to edit the spec."""
        return await self.patch(resource, namespace, name, {"spec": {"replicas": replicas}}, "scale")

    async def delete(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        uid: str | None = None,
        grace_seconds: int | None = None,
    ) -> bool:
        """Delete (background propagation); False when it was already gone or replaced (uid changed).

        `grace_seconds=0` kills at once: the health prober replaces hung workers that could not drain anyway.
        """
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            await self._request("delete", "DELETE", resource, resource.path(namespace, name), body)
        except ApiError as error:
            if error.status in (404, 409):
                return False
            raise
        return True


def api_error(status: int, text: str) -> ApiError:
    """The API server's Status response (or whatever text came instead) as an ApiError."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return ApiError(status, "Unknown", text[:1000])
    if not isinstance(payload, dict):
        return ApiError(status, "Unknown", text[:1000])
    details = payload.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    cause_types = tuple(
        str(cause.get("reason")) for cause in causes or () if isinstance(cause, dict) and cause.get("reason")
    )
    return ApiError(
        status,
        str(payload.get("reason", "Unknown")),
        str(payload.get("message", text[:1000])),
        cause_types,
    )


async def gather_limited(limit: int, *calls: Any) -> list[Any]:
    """Run coroutines with at most `limit` in flight; exceptions are returned, not raised."""
    semaphore = asyncio.Semaphore(limit)

    async def run(call: Any) -> Any:
        async with semaphore:
            return await call

    return await asyncio.gather(*(run(call) for call in calls), return_exceptions=True)
