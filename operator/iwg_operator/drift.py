"""Pure comparison of an owned object, as the API server shows it, with what the builders produce.

The reconciler repairs a child (server-side apply of the builder's manifest) when a field the operator sets
differs: someone edited it by hand, or the spec changed (the spec-hash annotation is one such field). Fields
the operator does not set (server defaults, status, other managers' labels and annotations) are not looked
at, and quantities compare by value ("0.5" and "500m" are the same CPU), so an object the operator wrote
compares equal to its manifest and an unchanged group causes no write.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from decimal import Decimal, DecimalException
from typing import Any

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def quantity(text: str) -> Decimal | None:
    """A Kubernetes quantity's value ("500m" -> 0.5, "1Gi" -> 1073741824); None when it is not one."""
    found = _QUANTITY.match(text)
    if found is None:
        return None
    try:
        return Decimal(found.group(1)) * _SUFFIX[found.group(2) or ""]
    except DecimalException:  # "1.2.3"; or a digest such as "3e43715140629679", whose exponent overflows
        return None


def _same_leaf(desired: Any, observed: Any) -> bool:
    if desired == observed:
        return True
    if isinstance(desired, str) and isinstance(observed, str):
        wanted, seen = quantity(desired), quantity(observed)
        return wanted is not None and wanted == seen
    return False


def matches(desired: Any, observed: Any) -> bool:
    """Every field of `desired` has its value in `observed` (maps: the keys of `desired` only; lists: the same
    length, item by item)."""
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            key in observed and matches(value, observed[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(desired) == len(observed)
            and all(matches(d, o) for d, o in zip(desired, observed, strict=True))
        )
    return _same_leaf(desired, observed)


def _project(desired: Any, observed: Any) -> Any:
    if isinstance(desired, Mapping) and isinstance(observed, Mapping):
        return {key: _project(value, observed.get(key)) for key, value in desired.items()}
    return observed


def fingerprint(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> str:
    """The observed values of the fields `desired` sets (lists whole), as a digest: what an apply left where
    it could not make the object match (another manager's item in a list the operator sets), so that the same
    state is not written again and again."""
    text = json.dumps(_project(desired, observed), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def owned_by(body: Mapping[str, Any], uid: str) -> bool:
    """The object names the group (by uid) among its owners."""
    owners = (body.get("metadata") or {}).get("ownerReferences") or []
    return any(owner.get("uid") == uid for owner in owners)


def metadata_digest(body: Mapping[str, Any]) -> tuple[int, str] | None:
    """(generation, digest of uid, labels, annotations, owners) of an object whose spec edits bump its generation
    (Deployment, PDB, NetworkPolicy); None for one without a generation (Service, ConfigMap, Secret)."""
    metadata = body.get("metadata") or {}
    generation = metadata.get("generation")
    if not generation:
        return None
    shown = [metadata.get(k) for k in ("uid", "labels", "annotations", "ownerReferences")]
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"))
    return int(generation), hashlib.sha256(text.encode()).hexdigest()[:16]


def in_sync(desired: Mapping[str, Any], observed: Mapping[str, Any], accepted: str | None = None) -> bool:
    """Nothing to write: the object carries the fields the operator sets, or it is exactly as the last apply
    left it (`accepted`, a fingerprint)."""
    return matches(_comparable(desired), observed) or (
        accepted is not None and fingerprint(_comparable(desired), observed) == accepted
    )


def _comparable(desired: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest without what is not compared field by field: ownerReferences (another owner may be added
    beside the group's; whether the group's is there is `owned_by`'s question)."""
    metadata = {k: v for k, v in (desired.get("metadata") or {}).items() if k != "ownerReferences"}
    return {**desired, "metadata": metadata}


def accepted_after_apply(desired: Mapping[str, Any], result: Mapping[str, Any]) -> str | None:
    """After an apply: None when the object now matches, else the fingerprint of what it left."""
    comparable = _comparable(desired)
    return None if matches(comparable, result) else fingerprint(comparable, result)


# Maps whose other keys are kept on a repair: labels and annotations belong to everybody.
_SHARED_MAPS = frozenset({("metadata", "labels"), ("metadata", "annotations")})


def repair_patch(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that puts back every field `desired` sets, for what server-side apply cannot mend:
    an item another field manager added to a list keyed by its fields (a Service port edited by hand is
    another port beside the operator's, and the two names clash). Lists are replaced whole; string maps
    (selectors, ConfigMap data, resource limits) lose keys the manifest has not, except labels and
    annotations; other fields (a Service's clusterIP) stay as they are."""
    patch = _patch(_comparable(desired), observed, ())
    assert isinstance(patch, dict)
    return patch


def _patch(desired: Any, observed: Any, path: tuple[str, ...]) -> Any:
    if not isinstance(desired, Mapping) or not isinstance(observed, Mapping):
        return desired
    patch = {key: _patch(value, observed.get(key), (*path, key)) for key, value in desired.items()}
    if path not in _SHARED_MAPS and all(isinstance(value, str) for value in desired.values()):
        patch.update({key: None for key in observed if key not in desired})
    return patch
