"""Pure translation of a pod's containers into processes: argv, environment, and files for the volumes.

What a kubelet and a container runtime would do with the image's filesystem is done with the host's: the
command runs from the test environment (the image name is not looked at), the volumes are materialised in a
directory per pod and bind-mounted at their mount paths in the pod's own mount namespace (tests/nodeagent/
launch.py), so the product reads the paths its manifest names.
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


class PodSpecError(ValueError):
    """The pod cannot be run here; the message names the field."""


class MissingObjectError(LookupError):
    """A Secret or ConfigMap the pod needs does not exist (yet)."""


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False
    tmpfs_size: str | None = None  # a memory-backed emptyDir: a tmpfs instead of a bind mount


@dataclass(frozen=True)
class ContainerPlan:
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    working_dir: str
    mounts: tuple[Mount, ...]
    hostname: str


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, unknown ones kept, $$ escapes."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(replace, text)


def parse_quantity(value: str) -> float:
    match = _QUANTITY.match(str(value))
    if not match or match.group(2) not in _SUFFIX:
        raise PodSpecError(f"unparseable resource quantity {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def field_ref(pod: Obj, path: str) -> str:
    """Downward API `fieldRef.fieldPath` of a pod whose status already has its IP."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "['") and path.endswith("']"):
            key = path[len(prefix) + 2 : -2]
            return str((meta.get(source) or {}).get(key, ""))
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path not in simple:
        raise PodSpecError(f"env valueFrom.fieldRef.fieldPath {path!r} is not supported")
    return str(simple[path])


def resource_ref(container: Obj, ref: Obj) -> str:
    resource = ref["resource"]
    kind, _, name = resource.partition(".")
    resources = (container.get("resources") or {}).get(kind) or {}
    divisor = parse_quantity(str(ref.get("divisor", "1")))
    if name in resources:
        value = parse_quantity(str(resources[name]))
    elif name == "cpu":
        value = float(os.cpu_count() or 1)
    elif name == "memory":
        value = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    else:
        value = 0.0
    return str(math.ceil(value / divisor))


def _decoded(obj: Obj) -> dict[str, bytes]:
    """A Secret's or ConfigMap's data as bytes."""
    if obj.get("kind") == "Secret":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
        return data
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def _lookup(objects: Mapping[tuple[str, str], Obj], kind: str, name: str, optional: bool) -> Obj | None:
    found = objects.get((kind, name))
    if found is None and not optional:
        raise MissingObjectError(f"{kind} {name!r} not found")
    return found


def resolve_env(
    pod: Obj, container: Obj, objects: Mapping[tuple[str, str], Obj], base: Mapping[str, str]
) -> dict[str, str]:
    """The container's environment: `base` (PATH and such), envFrom, then env in order with $(VAR)."""
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            if key in source:
                ref = source[key]
                obj = _lookup(objects, kind, ref["name"], bool(ref.get("optional")))
                for name, value in _decoded(obj or {}).items():
                    env[prefix + name] = value.decode()
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = resource_ref(container, source["resourceFieldRef"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind, key = (
                ("Secret", "secretKeyRef") if "secretKeyRef" in source else ("ConfigMap", "configMapKeyRef")
            )
            ref = source[key]
            obj = _lookup(objects, kind, ref["name"], bool(ref.get("optional")))
            data = _decoded(obj or {})
            if ref["key"] in data:
                env[name] = data[ref["key"]].decode()
            elif not ref.get("optional"):
                raise MissingObjectError(f"{kind} {ref['name']!r} has no key {ref['key']!r}")
        else:
            raise PodSpecError(f"env[{name}].valueFrom: unsupported source {sorted(source)}")
    return env


def referenced_objects(pod: Obj) -> set[tuple[str, str]]:
    """(kind, name) of every Secret and ConfigMap the pod reads."""
    spec = pod.get("spec") or {}
    wanted: set[tuple[str, str]] = set()
    for volume in spec.get("volumes") or []:
        if "secret" in volume:
            wanted.add(("Secret", volume["secret"]["secretName"]))
        if "configMap" in volume:
            wanted.add(("ConfigMap", volume["configMap"]["name"]))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "secret" in source:
                wanted.add(("Secret", source["secret"]["name"]))
            if "configMap" in source:
                wanted.add(("ConfigMap", source["configMap"]["name"]))
    for container in spec.get("containers") or []:
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                wanted.add(("Secret", source["secretRef"]["name"]))
            if "configMapRef" in source:
                wanted.add(("ConfigMap", source["configMapRef"]["name"]))
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            if "secretKeyRef" in source:
                wanted.add(("Secret", source["secretKeyRef"]["name"]))
            if "configMapKeyRef" in source:
                wanted.add(("ConfigMap", source["configMapKeyRef"]["name"]))
    return wanted


def _write_items(directory: Path, data: Mapping[str, bytes], items: list[Obj] | None, mode: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    selected = (
        [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else [(k, k, mode) for k in data]
    )
    for key, relative, file_mode in selected:
        if key not in data:
            raise MissingObjectError(f"key {key!r} not found for volume file {relative!r}")
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[key])
        target.chmod(file_mode)


def materialise_volumes(
    pod: Obj, root: Path, objects: Mapping[tuple[str, str], Obj]
) -> dict[str, Path | str]:
    """Writes each volume's files under `root/<volume>`; returns volume name -> directory (or a tmpfs size)."""
    result: dict[str, Path | str] = {}
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = volume["name"]
        directory = root / name
        if "secret" in volume:
            source = volume["secret"]
            obj = _lookup(objects, "Secret", source["secretName"], bool(source.get("optional")))
            _write_items(
                directory, _decoded(obj or {}), source.get("items"), source.get("defaultMode", 0o644)
            )
        elif "configMap" in volume:
            source = volume["configMap"]
            obj = _lookup(objects, "ConfigMap", source["name"], bool(source.get("optional")))
            _write_items(
                directory, _decoded(obj or {}), source.get("items"), source.get("defaultMode", 0o644)
            )
        elif "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                result[name] = str(int(parse_quantity(str(empty.get("sizeLimit", "64Mi")))))
                continue
            directory.mkdir(parents=True, exist_ok=True)
        elif "downwardAPI" in volume:
            data = {
                item["path"]: field_ref(pod, item["fieldRef"]["fieldPath"]).encode()
                for item in volume["downwardAPI"].get("items") or []
                if "fieldRef" in item
            }
            _write_items(directory, data, None, 0o644)
        elif "projected" in volume:
            data: dict[str, bytes] = {}
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    # No workload here talks to the API server; an empty token keeps the path valid.
                    data[source["serviceAccountToken"].get("path", "token")] = b""
                elif "configMap" in source or "secret" in source:
                    kind = "ConfigMap" if "configMap" in source else "Secret"
                    ref = source["configMap" if kind == "ConfigMap" else "secret"]
                    obj = _lookup(objects, kind, ref["name"], bool(ref.get("optional")))
                    decoded = _decoded(obj or {})
                    for item in ref.get("items") or [{"key": k, "path": k} for k in decoded]:
                        data[item["path"]] = decoded.get(item["key"], b"")
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"].get("items") or []:
                        if "fieldRef" in item:
                            data[item["path"]] = field_ref(pod, item["fieldRef"]["fieldPath"]).encode()
            _write_items(directory, data, None, 0o644)
        elif "hostPath" in volume:
            result[name] = Path(volume["hostPath"]["path"])
            continue
        else:
            raise PodSpecError(f"spec.volumes[{name}]: unsupported volume type {sorted(volume)}")
        result[name] = directory
    return result


def plan_container(
    pod: Obj,
    container: Obj,
    volumes: Mapping[str, Path | str],
    objects: Mapping[tuple[str, str], Obj],
    base_env: Mapping[str, str],
    default_workdir: str,
) -> ContainerPlan:
    name = container["name"]
    spec = pod.get("spec") or {}
    hostname = spec.get("hostname") or pod["metadata"]["name"]
    env = resolve_env(pod, container, objects, {**base_env, "HOSTNAME": hostname})
    command = [expand(c, env) for c in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    if not command:
        raise PodSpecError(
            f"spec.containers[{name}].command is required here: the node agent runs commands, not images"
        )
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = volumes.get(mount["name"])
        if source is None:
            raise PodSpecError(f"spec.containers[{name}].volumeMounts: no volume {mount['name']!r}")
        target = mount["mountPath"]
        if isinstance(source, str):
            mounts.append(Mount(source="tmpfs", target=target, tmpfs_size=source))
            continue
        if mount.get("subPath"):
            source = source / mount["subPath"]
        mounts.append(Mount(source=str(source), target=target, read_only=bool(mount.get("readOnly"))))
    return ContainerPlan(
        name=name,
        argv=tuple(command + args),
        env=env,
        working_dir=container.get("workingDir") or default_workdir,
        mounts=tuple(mounts),
        hostname=hostname,
    )
