"""A small asyncio client for the Kubernetes API: just what a kubelet-like agent needs.

Reads the token and CA of a kubeconfig (the one the test control plane writes). LIST + WATCH keep a
local cache per resource (an informer), so the agent never polls.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

log = logging.getLogger("nodeagent.kubeapi")

Obj = dict[str, Any]


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str
    ca_data: bytes

    @classmethod
    def from_kubeconfig(cls, path: Path | str) -> Credentials:
        config = yaml.safe_load(Path(path).read_text())
        context_name = config.get("current-context")
        contexts = {c["name"]: c["context"] for c in config.get("contexts", [])}
        context = contexts.get(context_name) or next(iter(contexts.values()))
        clusters = {c["name"]: c["cluster"] for c in config["clusters"]}
        users = {u["name"]: u["user"] for u in config["users"]}
        cluster, user = clusters[context["cluster"]], users[context["user"]]
        if "token" not in user:
            raise ValueError(f"{path}: the node agent needs a token user in the kubeconfig")
        return cls(
            server=cluster["server"],
            token=user["token"],
            ca_data=base64.b64decode(cluster["certificate-authority-data"]),
        )


class KubeApi:
    def __init__(self, credentials: Credentials) -> None:
        self._creds = credentials
        context = ssl.create_default_context(cadata=credentials.ca_data.decode())
        self._session = aiohttp.ClientSession(
            base_url=credentials.server,
            headers={"Authorization": f"Bearer {credentials.token}"},
            connector=aiohttp.TCPConnector(ssl=context, limit=32),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Obj | None = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        data = json.dumps(body) if body is not None else None
        async with self._session.request(
            method,
            path,
            data=data,
            params=params,
            headers={"Content-Type": content_type},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as response:
            text = await response.text()
            if response.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise ApiError(response.status, message)
            result: Obj = json.loads(text) if text else {}
            return result

    async def get(self, path: str) -> Obj:
        return await self.request("GET", path)

    async def create(self, path: str, body: Obj) -> Obj:
        return await self.request("POST", path, body=body)

    async def merge_patch(self, path: str, body: Obj) -> Obj:
        return await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    async def strategic_patch(self, path: str, body: Obj) -> Obj:
        return await self.request(
            "PATCH", path, body=body, content_type="application/strategic-merge-patch+json"
        )

    async def delete(self, path: str, body: Obj | None = None) -> Obj:
        return await self.request("DELETE", path, body=body)

    async def watch(self, path: str, resource_version: str) -> AsyncIterator[Obj]:
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "240",
        }
        async with self._session.get(
            path, params=params, timeout=aiohttp.ClientTimeout(total=None, sock_read=300)
        ) as response:
            if response.status >= 400:
                raise ApiError(response.status, await response.text())
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)


def key_of(obj: Obj) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


class Informer:
    """LIST then WATCH one collection; keeps `items` current and calls `on_change` after every event."""

    def __init__(
        self,
        api: KubeApi,
        path: str,
        on_change: Callable[[str, Obj], Awaitable[None] | None] | None = None,
    ) -> None:
        self.api = api
        self.path = path
        self.items: dict[tuple[str, str], Obj] = {}
        self.synced = asyncio.Event()
        self._on_change = on_change

    async def run(self) -> None:
        while True:
            try:
                listing = await self.api.get(self.path)
                fresh = {key_of(o): o for o in listing.get("items", [])}
                gone = [o for k, o in self.items.items() if k not in fresh]
                self.items = fresh
                self.synced.set()
                for obj in gone:
                    await self._notify("DELETED", obj)
                for obj in fresh.values():
                    await self._notify("MODIFIED", obj)
                version = listing["metadata"]["resourceVersion"]
                while True:
                    async for event in self.api.watch(self.path, version):
                        kind, obj = event["type"], event["object"]
                        if kind == "ERROR":
                            raise ApiError(obj.get("code", 500), obj.get("message", "watch error"))
                        version = obj["metadata"]["resourceVersion"]
                        if kind == "BOOKMARK":
                            continue
                        if kind == "DELETED":
                            self.items.pop(key_of(obj), None)
                        else:
                            self.items[key_of(obj)] = obj
                        await self._notify(kind, obj)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the API server restarts, a watch expires: list again
                log.debug("informer %s restarts: %s", self.path, error)
                await asyncio.sleep(0.5)

    async def _notify(self, kind: str, obj: Obj) -> None:
        if self._on_change is None:
            return
        result = self._on_change(kind, obj)
        if result is not None:
            await result
