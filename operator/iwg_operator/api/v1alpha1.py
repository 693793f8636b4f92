"""InferenceWorkerGroup v1alpha1: the pydantic models that are the single source of the CRD.

The operator, the driver, `iwg serve` and the CRD generator all read these models. Cross-field rules are
declared once (`CrossFieldRule`): pydantic checks them in Python, and the CRD generator turns the same rules
into CEL `x-kubernetes-validations`, so the API server and `iwg serve` reject the same manifests with the
same messages.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from iwg_operator.api import embedded, wiring

GROUP = "inference.iwg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceWorkerGroup"
PLURAL = "inferenceworkergroups"
SINGULAR = "inferenceworkergroup"
SHORT_NAMES = ("iwg",)

DEFAULT_WORKER_IMAGE = "ghcr.io/iwg-dev/iwg-worker:0.1.0"
# Pod names are `<group>-r<replica>-w<rank>` and must stay valid DNS labels (63 characters) for per-pod DNS.
MAX_GROUP_NAME_LENGTH = 40
MAX_REPLICAS = 1000
MAX_WORLD_SIZE = 64
MAX_DRIVER_REPLICAS = 5
# The driver is one asyncio process (HTTP, batching, ZMQ): a core and 1Gi hold a full queue of requests.
DEFAULT_DRIVER_CPU = "1"
DEFAULT_DRIVER_MEMORY = "1Gi"
DEFAULT_WORKER_TMP_SIZE = "1Gi"
DEFAULT_DRIVER_TMP_SIZE = "256Mi"
TMP_SIZE_DESCRIPTION = (
    "Size of /tmp (an emptyDir; the root filesystem is read-only) and the pod's ephemeral-storage request "
    "and limit, which the container's logs count toward too."
)
# A model path may name a directory shipped inside an installed Python package: `pkg:<module>/<subdir>`.
PACKAGE_PATH_PREFIX = "pkg:"

DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
CLASS_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"
# An image reference as container runtimes parse it: [domain[:port]/]path[:tag][@digest] (the grammar of
# github.com/distribution/reference, written out here). RE2 and Python accept it alike.
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_PATTERN = rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$"
# A label value (Kubernetes IsValidLabelValue), for values the operator copies into node selectors.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A string a process can receive (environment variables, paths): no NUL byte.
NO_NUL_PATTERN = r"^[^\x00]*$"
# An absolute path in normal form: no `.`, `..` or empty segments, no trailing slash (a volume's mountPath).
CLEAN_ABSOLUTE_PATH_PATTERN = r"^(/([^/.\x00][^/\x00]*|[.][^/.\x00][^/\x00]*|[.][.][^/\x00]+))+$"
# Where the operator mounts its own volumes in worker and driver pods (shared memory, scratch space, the CURVE
# keys): a model volume there would collide with them (tests/iwg_operator/test_builders.py keeps this in step).
POD_MOUNT_PATHS = ("/dev/shm", "/tmp", "/etc/iwg/curve")
# A `..` segment anywhere in a path.
PARENT_SEGMENT_PATTERN = r"(^|/)[.][.](/|$)"
# `pkg:<module>/<subdir>`: a dotted module name, then a relative directory inside the package.
PACKAGE_PATH_PATTERN = r"^pkg:[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*/[^/\x00][^\x00]*$"
QUANTITY_PATTERN = r"^(\+)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# Environment variables the operator owns (api/wiring.py); a user's `worker.env` may not override them.
RESERVED_ENV_PREFIX = "IWG_"
RESERVED_ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


# Quantities above 2^53 (8Pi) parse but overflow what the scheduler and kubelet compute with.
MAX_QUANTITY = "8Pi"
_MAX_QUANTITY_VALUE = Decimal(2**53)
_QUANTITY_SUFFIXES = {
    **{f"{p}i": Decimal(1024) ** (i + 1) for i, p in enumerate("KMGTPE")},
    **{s: Decimal(10) ** e for s, e in zip("numkMGTPE", (-9, -6, -3, 3, 6, 9, 12, 15, 18), strict=True)},
}


def quantity_value(text: str) -> Decimal:
    """A quantity that matches QUANTITY_PATTERN as a number (`1Ki` -> 1024, `1e3` -> 1000, `5m` -> 0.005).

    A suffix is the last one or two letters; an exponent (`e3`, `E+3`) always ends in a digit.
    """
    for length in (2, 1):
        multiplier = _QUANTITY_SUFFIXES.get(text[-length:])
        if multiplier is not None:
            return Decimal(text[:-length]) * multiplier
    return Decimal(text)


def _quantity_within_bounds(text: str) -> str:
    if quantity_value(text) > _MAX_QUANTITY_VALUE:
        raise ValueError(f"must be at most {MAX_QUANTITY}")
    return text


def _quantity_to_str(value: object) -> object:
    if isinstance(value, bool):
        return value  # rejected by the str check with a clear message
    if isinstance(value, int | float):
        return str(value)
    return value


# A non-negative Kubernetes resource quantity ("2", "500m", "16Gi") of at most MAX_QUANTITY; YAML may give it
# as a number.
Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    AfterValidator(_quantity_within_bounds),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                {
                    "rule": (
                        f"type(self) == int ? self <= {2**53} : "
                        f"(!isQuantity(self) || quantity(self).compareTo(quantity('{MAX_QUANTITY}')) <= 0)"
                    ),
                    "message": f"must be at most {MAX_QUANTITY}",
                }
            ],
        }
    ),
]


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields of one object: `cel` for the API server, `check` for Python.

    `message` names the fields with their full manifest paths; `field_path` (relative to the object, e.g.
    `.minReplicas`) is the field the API server reports.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None


class ApiModel(BaseModel):
    """Base of every API object: camelCase in manifests, snake_case in Python, unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )
    cross_field_rules: ClassVar[tuple[CrossFieldRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> ApiModel:
        for rule in type(self).cross_field_rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        rules = cls.__dict__.get("cross_field_rules", ())
        if rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [
                {"rule": r.cel, "message": r.message} | ({"fieldPath": r.field_path} if r.field_path else {})
                for r in rules
            ]
        return schema

    def to_manifest(self) -> dict[str, Any]:
        """The object as it appears in a manifest: camelCase keys, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------------------- model


class ModelVolume(ApiModel):
    """A PersistentVolumeClaim holding the model, mounted read-only into every worker pod."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        description="Name of the PersistentVolumeClaim in the group's namespace.",
    )
    mount_path: str = Field(
        default="/models",
        min_length=2,
        max_length=1024,
        description=(
            "Where the claim is mounted in the worker container: an absolute path without `.`, `..` or empty "
            "segments; model.path must lie under it."
        ),
    )

    cross_field_rules = (
        CrossFieldRule(
            cel=f"self.mountPath.matches('{CLEAN_ABSOLUTE_PATH_PATTERN}')",
            message=(
                "spec.model.volume.mountPath must be an absolute path without '.', '..' or empty segments "
                "and without a trailing slash"
            ),
            check=lambda v: re.fullmatch(CLEAN_ABSOLUTE_PATH_PATTERN, v.mount_path) is not None,
            field_path=".mountPath",
        ),
        CrossFieldRule(
            cel=" && ".join(
                f"self.mountPath != '{p}' && !self.mountPath.startsWith('{p}/')" for p in POD_MOUNT_PATHS
            ),
            message=(
                f"spec.model.volume.mountPath must not be or lie under {', '.join(POD_MOUNT_PATHS)} "
                "(the operator mounts its own volumes there)"
            ),
            check=lambda v: not any(_path_under(v.mount_path, p) for p in POD_MOUNT_PATHS),
            field_path=".mountPath",
        ),
    )


class KvCacheSpec(ApiModel):
    """Size of a generation replica's paged KV cache (task `generate`); at most one of the two."""

    blocks: int | None = Field(
        default=None,
        ge=16,
        le=10_000_000,
        description=(
            "Cache size in blocks of 64 tokens (every layer's keys and values). Requests beyond what fits wait, "
            "or running ones are offloaded and resumed later; none fails."
        ),
    )
    memory_fraction: float | None = Field(
        default=None,
        gt=0.0,
        le=0.95,
        description=(
            "Cache size as a fraction of the device memory free after the model is loaded. Default (neither "
            "set): transformers' own share on a GPU (0.9 of free memory in most setups); on CPU a quarter of "
            "available memory (the host's, bounded by the worker container's memory limit), at most 2 GiB."
        ),
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="!(has(self.blocks) && has(self.memoryFraction))",
            message="spec.model.kvCache takes blocks or memoryFraction, not both",
            check=lambda k: k.blocks is None or k.memory_fraction is None,
            field_path=".blocks",
        ),
    )


class ModelSpec(ApiModel):
    """The model every worker loads."""

    task: Literal["embed", "generate"] = Field(
        description="What the model serves: `embed` (/v1/embeddings) or `generate` (/v1/completions)."
    )
    path: str = Field(
        min_length=1,
        max_length=1024,
        pattern=NO_NUL_PATTERN,
        description=(
            "Directory of the model (config, weights, tokenizer) inside the worker container, or "
            "`pkg:<module>/<subdir>` for a directory shipped in an installed Python package; no `..` segments."
        ),
    )
    volume: ModelVolume | None = Field(
        default=None, description="Optional PersistentVolumeClaim that provides model.path."
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Model name clients send in requests; defaults to the group's name.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Weight and activation dtype; `auto` takes the model's own."
    )
    kv_cache: KvCacheSpec | None = Field(
        default=None, description="KV cache size of each generation replica (task `generate` only)."
    )
    engine: Literal["auto", "vllm", "transformers"] = Field(
        default="auto",
        description=(
            "Generation engine of each replica (task `generate`): `auto` runs vLLM's engine where the worker "
            "image has vLLM installed and vLLM supports the model's architecture (a Hugging Face model "
            "directory), else transformers' continuous-batching engine; `vllm` requires vLLM's engine: a worker "
            "whose image lacks vLLM or whose model vLLM cannot load fails to start, and the group's Degraded "
            "condition (reason WorkerFailed) gives the reason; `transformers` always runs transformers' "
            "continuous-batching engine (which also loads GGUF files without conversion). status.engine shows "
            "the engine the workers chose. Task `embed` runs no generation engine: `vllm` is refused there."
        ),
    )
    chat_template: str | None = Field(
        default=None,
        min_length=1,
        max_length=65536,
        description=(
            "Task `generate` only: a Jinja chat template that replaces the one in the model's tokenizer "
            "config, as vLLM's `--chat-template` does (for a model that ships none, or to give a model the "
            "tools). /v1/chat/completions renders messages with it on both engines; a template that renders "
            "`tools` and writes calls as `<tool_call>` blocks (the Hermes format) makes `tool_choice: auto` "
            "available (docs/driver.md). A change rolls the workers, not the driver."
        ),
    )
    enforce_eager: bool = Field(
        default=False,
        description=(
            "vLLM engine only: run the model eagerly instead of compiling it with torch.compile. Compiling is "
            "vLLM's default; on a 2-core CPU it took about 110 s more to start SmolLM2-135M and gave about 9% "
            "more tokens/s at 32 streams; eager suits groups that must start fast (tests, scale from zero, "
            "frequent rollouts), compiled suits long-running groups. Ignored by the transformers engine."
        ),
    )

    cross_field_rules = (
        CrossFieldRule(
            cel=f"!self.path.matches('{PARENT_SEGMENT_PATTERN}')",
            message="spec.model.path must not contain '..' segments",
            check=lambda m: re.search(PARENT_SEGMENT_PATTERN, m.path) is None,
            field_path=".path",
        ),
        CrossFieldRule(
            cel=(
                "!has(self.volume) || self.path == self.volume.mountPath || "
                "self.path.startsWith(self.volume.mountPath + '/')"
            ),
            message="spec.model.path must lie under spec.model.volume.mountPath (as a path, not a string prefix)",
            check=lambda m: m.volume is None or _path_under(m.path, m.volume.mount_path),
            field_path=".path",
        ),
        CrossFieldRule(
            cel=f"!self.path.startsWith('pkg:') || self.path.matches('{PACKAGE_PATH_PATTERN}')",
            message="spec.model.path pkg: references must read pkg:<module>/<subdir> (a dotted module name)",
            check=lambda m: (
                not m.path.startswith(PACKAGE_PATH_PREFIX)
                or re.fullmatch(PACKAGE_PATH_PATTERN, m.path) is not None
            ),
            field_path=".path",
        ),
        CrossFieldRule(
            cel="!has(self.volume) || !self.path.startsWith('pkg:')",
            message="spec.model.path cannot be a pkg: path when spec.model.volume is set",
            check=lambda m: m.volume is None or not m.path.startswith(PACKAGE_PATH_PREFIX),
            field_path=".path",
        ),
        CrossFieldRule(
            cel="self.task == 'generate' || !has(self.engine) || self.engine != 'vllm'",
            message=(
                "spec.model.engine vllm needs spec.model.task generate (an embed group runs no generation "
                "engine; leave spec.model.engine at auto)"
            ),
            check=lambda m: m.task == "generate" or m.engine != "vllm",
            field_path=".engine",
        ),
        CrossFieldRule(
            cel=(
                "!has(self.enforceEager) || !self.enforceEager || !has(self.engine) || "
                "self.engine != 'transformers'"
            ),
            message=(
                "spec.model.enforceEager applies to vLLM's engine only and spec.model.engine transformers would "
                "ignore it (leave spec.model.enforceEager false, or set spec.model.engine to auto or vllm)"
            ),
            check=lambda m: not m.enforce_eager or m.engine != "transformers",
            field_path=".enforceEager",
        ),
        CrossFieldRule(
            cel="self.task == 'generate' || !has(self.chatTemplate)",
            message="spec.model.chatTemplate needs spec.model.task generate (an embed group renders no chats)",
            check=lambda m: m.task == "generate" or m.chat_template is None,
            field_path=".chatTemplate",
        ),
    )

    def resolved_path(self) -> Path:
        """The model directory on this machine; `pkg:<module>/<subdir>` is looked up without importing it."""
        return resolve_model_path(self.path)


def _path_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + "/")


def resolve_model_path(path: str) -> Path:
    """A model path as the worker finds it: `pkg:<module>/<subdir>` inside an installed package, else as is.

    The operator passes spec.model.path unchanged (IWG_MODEL_PATH); the worker resolves it in its own image.
    """
    if not path.startswith(PACKAGE_PATH_PREFIX):
        return Path(path)
    module, _, subdir = path[len(PACKAGE_PATH_PREFIX) :].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"spec.model.path: Python package {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / subdir


# --------------------------------------------------------------------------------------------------- worker


class EnvVar(ApiModel):
    """A plain environment variable for the worker container."""

    name: str = Field(min_length=1, max_length=128, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str = Field(
        default="", max_length=4096, pattern=NO_NUL_PATTERN, description="Variable value (no NUL byte)."
    )


def _env_is_not_reserved(env: EnvVar) -> bool:
    return not env.name.startswith(RESERVED_ENV_PREFIX) and env.name not in RESERVED_ENV_NAMES


class WorkerSpec(ApiModel):
    """The worker pods: one per rank of every replica."""

    image: str = Field(
        default=DEFAULT_WORKER_IMAGE,
        min_length=1,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description="Worker container image: a reference `[registry/]repository[:tag][@digest]`.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the worker image."
    )
    gpus: int = Field(default=1, ge=0, le=16, description="nvidia.com/gpu per pod; 0 runs on CPU.")
    cpu: Quantity | None = Field(
        default=None, description="CPU request and limit per pod (e.g. `4`, `500m`)."
    )
    memory: Quantity | None = Field(
        default=None, description="Memory request and limit per pod (e.g. `32Gi`)."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables; names starting with IWG_ and the torch rendezvous names are reserved.",
    )
    worker_cls: str | None = Field(
        default=None,
        max_length=256,
        pattern=CLASS_NAME_PATTERN,
        description="Qualified name of the WorkerBase implementation; the runtime's default when unset.",
    )
    worker_extension_cls: str | None = Field(
        default=None,
        max_length=256,
        pattern=CLASS_NAME_PATTERN,
        description="Qualified name of a mixin class applied to the worker class.",
    )
    shm_size: Quantity = Field(default="1Gi", description="Size of /dev/shm (a memory-backed emptyDir).")
    tmp_size: Quantity = Field(default=DEFAULT_WORKER_TMP_SIZE, description=TMP_SIZE_DESCRIPTION)
    device: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="Device the worker runs on; `auto` picks cuda when a GPU is visible."
    )
    egress: Literal["Restricted", "Unrestricted"] = Field(
        default="Restricted",
        description=(
            "What worker pods may connect to (their NetworkPolicy `<group>-workers`): `Restricted` admits the "
            "group's own worker pods (any port), the group's driver pods (ZMQ ports 5555, 5556) and DNS (port "
            "53, UDP and TCP, to any address); `Unrestricted` admits any destination. Workers load models from "
            "local paths only, so nothing built in needs more; an extension that reads from other storage "
            "needs `Unrestricted`, or a NetworkPolicy of your own that admits that egress (policies add up). "
            "A change updates the policy in place and rolls no pod."
        ),
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="!has(self.env) || self.env.all(e, !e.name.startsWith('IWG_') && !(e.name in ['MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE']))",
            message="spec.worker.env must not set IWG_* or MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (the operator sets them)",
            check=lambda w: all(_env_is_not_reserved(e) for e in w.env),
            field_path=".env",
        ),
        CrossFieldRule(
            cel="self.gpus > 0 || self.device != 'cuda'",
            message="spec.worker.device cuda needs spec.worker.gpus > 0",
            check=lambda w: w.gpus > 0 or w.device != "cuda",
            field_path=".device",
        ),
    )


# --------------------------------------------------------------------------------------------------- driver


class BatchingSpec(ApiModel):
    """How the driver groups requests into batches."""

    max_batch_size: int = Field(default=32, ge=1, le=4096, description="Most requests in one batch.")
    max_wait_ms: int = Field(
        default=5,
        ge=0,
        le=10000,
        description="Longest a request waits for its batch to fill, in milliseconds.",
    )
    max_queue: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="Most queued requests; beyond it the driver answers 429.",
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="self.maxQueue >= self.maxBatchSize",
            message="spec.driver.batching.maxQueue must be at least spec.driver.batching.maxBatchSize",
            check=lambda b: b.max_queue >= b.max_batch_size,
            field_path=".maxQueue",
        ),
    )


class LabelSelectorRequirement(ApiModel):
    """One expression of a label selector (as in meta/v1)."""

    key: str = Field(min_length=1, max_length=316, description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How values are matched.")
    values: list[str] = Field(
        default_factory=list, max_length=64, description="Values for In and NotIn; empty otherwise."
    )


class LabelSelector(ApiModel):
    """A label selector (as in meta/v1); an empty selector selects everything."""

    match_labels: dict[str, str] | None = Field(
        default=None, max_length=32, description="Labels that must all be present."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=32, description="Expressions that must all hold."
    )


# The longest CIDR: a full IPv6 address and "/128".
CIDR_MAX_LENGTH = 43


def _is_cidr(text: str) -> bool:
    """An address and a prefix length, as Kubernetes' CEL isCIDR() and NetworkPolicy validation take it."""
    address, slash, length = text.partition("/")
    if not slash or not length.isdigit():
        return False
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return address == address.strip()


class IPBlock(ApiModel):
    """A CIDR with optional exceptions (as in networking/v1)."""

    cidr: str = Field(min_length=1, max_length=CIDR_MAX_LENGTH, description="Allowed CIDR, e.g. 10.0.0.0/8.")
    except_: list[Annotated[str, Field(max_length=CIDR_MAX_LENGTH)]] | None = Field(
        default=None,
        alias="except",
        max_length=16,
        description="CIDRs inside cidr that are not allowed.",
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="isCIDR(self.cidr)",
            message="spec.driver.networkPolicy.httpFrom[].ipBlock.cidr must be a CIDR (address/prefix length)",
            check=lambda b: _is_cidr(b.cidr),
            field_path=".cidr",
        ),
        CrossFieldRule(
            cel="!has(self.except) || self.except.all(c, isCIDR(c))",
            message="spec.driver.networkPolicy.httpFrom[].ipBlock.except must hold CIDRs (address/prefix length)",
            check=lambda b: all(_is_cidr(c) for c in b.except_ or []),
            field_path=".except",
        ),
    )


class NetworkPolicyPeer(ApiModel):
    """A source of traffic (as in networking/v1): pods, namespaces, or addresses."""

    pod_selector: LabelSelector | None = Field(default=None, description="Pods, in the namespaces selected.")
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces; the group's own when unset."
    )
    ip_block: IPBlock | None = Field(default=None, description="Addresses; excludes the two selectors.")

    cross_field_rules = (
        CrossFieldRule(
            cel="has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
            message="spec.driver.networkPolicy.httpFrom[] needs podSelector, namespaceSelector or ipBlock",
            check=lambda p: (
                p.pod_selector is not None or p.namespace_selector is not None or p.ip_block is not None
            ),
        ),
        CrossFieldRule(
            cel="!has(self.ipBlock) || (!has(self.podSelector) && !has(self.namespaceSelector))",
            message="spec.driver.networkPolicy.httpFrom[].ipBlock excludes podSelector and namespaceSelector",
            check=lambda p: p.ip_block is None or (p.pod_selector is None and p.namespace_selector is None),
            field_path=".ipBlock",
        ),
    )


class RoutingSpec(ApiModel):
    """How the driver picks a replica for each generation request (task `generate`; embedding batches always
    go to the least-loaded replica)."""

    policy: Literal["cacheAware", "leastLoaded"] = Field(
        default="cacheAware",
        description=(
            "cacheAware: the replica expected to hold the longest cached prefix of the prompt (the driver "
            "remembers the prompt blocks it sent to each replica), bounded by loadBound; a prompt whose prefix "
            "no replica holds goes to the replica that rendezvous hashing of its first block picks, so that "
            "every driver sends it to the same one. leastLoaded: the replica with the fewest open requests."
        ),
    )
    load_bound: float = Field(
        default=0.25,
        ge=0.0,
        le=100.0,
        description=(
            "cacheAware: no replica is given a request that would put it above ceil((1 + loadBound) x the mean "
            "open requests per serving replica); the next replica in its order takes it instead."
        ),
    )


class DriverNetworkPolicySpec(ApiModel):
    """The driver's NetworkPolicy."""

    http_from: list[NetworkPolicyPeer] = Field(
        default_factory=list,
        max_length=32,
        description=(
            "Sources admitted to the HTTP port, besides the operator (metrics, drains); empty admits the pods of"
            " the group's own namespace only. Other namespaces: a namespaceSelector (`{}` for all of them);"
            " addresses outside the cluster: an ipBlock."
        ),
    )


class DriverSpec(ApiModel):
    """The group's driver: HTTP front end, batcher and ZMQ executor for all replicas."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description="Driver image (a reference like spec.worker.image); the worker image when unset.",
    )
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description=(
            f"HTTP port of the driver and its Service; not {wiring.DEFAULT_RPC_PORT} or "
            f"{wiring.DEFAULT_RESPONSE_PORT} (the driver's ZMQ ports)."
        ),
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_DRIVER_REPLICAS,
        description=(
            "Driver pods behind the group's Service; every worker serves every driver. Updates roll one surge "
            "pod at a time (an old pod stops once its successor is Ready), whatever the count; with more than "
            "one, a PodDisruptionBudget keeps one during voluntary disruption."
        ),
    )
    lame_duck_seconds: int = Field(
        default=int(wiring.DEFAULT_DRIVER_LAME_DUCK_S),
        ge=0,
        le=300,
        description=(
            "Seconds a driver pod keeps serving after SIGTERM (each answer closing its connection) before it "
            "stops accepting connections: the time the cluster takes to stop sending it new ones (the "
            "EndpointSlice update reaching kube-proxy on every node, or a load balancer's deregistration). "
            "The pod's terminationGracePeriodSeconds is this plus 30 s to finish admitted requests plus 5."
        ),
    )
    cpu: Quantity = Field(default=DEFAULT_DRIVER_CPU, description="CPU request and limit of the driver pod.")
    memory: Quantity = Field(
        default=DEFAULT_DRIVER_MEMORY, description="Memory request and limit of the driver pod."
    )
    tmp_size: Quantity = Field(default=DEFAULT_DRIVER_TMP_SIZE, description=TMP_SIZE_DESCRIPTION)
    batching: BatchingSpec = Field(default_factory=BatchingSpec, description="Request batching.")
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec, description="Routing of generation requests to replicas."
    )
    network_policy: DriverNetworkPolicySpec = Field(
        default_factory=DriverNetworkPolicySpec,
        description="Who may reach the driver; its ZMQ ports admit only the group's worker pods.",
    )

    cross_field_rules = (
        CrossFieldRule(
            cel=f"self.port != {wiring.DEFAULT_RPC_PORT} && self.port != {wiring.DEFAULT_RESPONSE_PORT}",
            message=(
                f"spec.driver.port must not be {wiring.DEFAULT_RPC_PORT} or {wiring.DEFAULT_RESPONSE_PORT} "
                "(the driver's ZMQ ports)"
            ),
            check=lambda d: d.port not in (wiring.DEFAULT_RPC_PORT, wiring.DEFAULT_RESPONSE_PORT),
            field_path=".port",
        ),
    )


# ----------------------------------------------------------------------------------------------- scheduling


class NestedFieldErrors(ValueError):
    """Errors inside a field's value, each with its path below the field (`.nodeAffinity`, `[0]`)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


def _embedded(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def check(value: dict[str, Any]) -> dict[str, Any]:
        problems = embedded.errors(name, value)
        if problems:
            raise NestedFieldErrors(problems)
        return value

    return check


# A core/v1 Affinity with its real schema (from the API server's OpenAPI document): unknown keys are errors.
Affinity = Annotated[
    dict[str, Any],
    AfterValidator(_embedded(embedded.AFFINITY)),
    WithJsonSchema(embedded.schema(embedded.AFFINITY)),
]


class Toleration(ApiModel):
    """A pod toleration (as in core/v1)."""

    key: str | None = Field(
        default=None, max_length=316, description="Taint key; empty with Exists matches all."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="How the value is matched.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; all effects when unset."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="spec.scheduling.tolerations[].value must be empty when operator is Exists",
            check=lambda t: t.operator != "Exists" or not t.value,
            field_path=".value",
        ),
        CrossFieldRule(
            cel="has(self.key) || self.operator == 'Exists'",
            message="spec.scheduling.tolerations[].key may only be empty with operator Exists",
            check=lambda t: t.key is not None or t.operator == "Exists",
            field_path=".key",
        ),
    )


class SchedulingSpec(ApiModel):
    """Where worker pods may run."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Node labels every worker pod requires."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Extra tolerations; the nvidia.com/gpu taint is tolerated automatically when gpus > 0.",
    )
    affinity: Affinity | None = Field(
        default=None,
        description=(
            "A core/v1 Affinity merged into every worker pod (co-location terms are added to it); its schema is "
            "the API server's own, so `kubectl apply` (strict field validation) refuses a misspelt key."
        ),
    )
    gpu_product: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="Required value of the node label nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3).",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="GPUs of one node, when known; admission then rejects co-located replicas that cannot fit.",
    )
    colocate_ranks: bool = Field(
        default=False, description="Keep all ranks of one replica on one node (required pod affinity)."
    )
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="PriorityClass of the worker pods."
    )
    scheduler_name: str | None = Field(
        default=None,
        max_length=253,
        description="Scheduler of the worker pods; the default scheduler when unset.",
    )
    gang: bool | None = Field(
        default=None,
        description=(
            "Gang placement by the cluster's own scheduler: one Workload per group and one PodGroup per "
            "replica (scheduling.k8s.io/v1beta1), so no pod of a replica binds until all worldSize pods "
            "fit. Default: on when worldSize > 1. Where the cluster does not serve that API, pods are "
            "placed one by one and the condition GangScheduling is False."
        ),
    )


# ------------------------------------------------------------------------------------------ health/scaling


class HealthSpec(ApiModel):
    """How workers are probed and what happens when they fail."""

    period_seconds: int = Field(default=5, ge=1, le=3600, description="Seconds between probes.")
    timeout_seconds: int = Field(default=3, ge=1, le=600, description="Seconds a probe may take.")
    failure_threshold: int = Field(
        default=3, ge=1, le=100, description="Consecutive failed probes before a worker counts as unhealthy."
    )
    restart_policy: Literal["Pod", "Replica"] = Field(
        default="Replica",
        description="Replace only the failed pod, or every pod of its replica (needed when ranks share state).",
    )
    max_restarts: int = Field(
        default=10,
        ge=0,
        le=10000,
        description="Restart budget per restartWindowSeconds; 0 disables restarts.",
    )
    restart_window_seconds: int = Field(
        default=3600, ge=60, le=604800, description="Window of the restart budget, in seconds."
    )
    backoff_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description="Delay before the first restart of a replica; doubles each time.",
    )
    max_backoff_seconds: int = Field(
        default=300, ge=0, le=86400, description="Upper bound of the restart delay."
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="self.timeoutSeconds <= self.periodSeconds",
            message="spec.health.timeoutSeconds must not exceed spec.health.periodSeconds",
            check=lambda h: h.timeout_seconds <= h.period_seconds,
            field_path=".timeoutSeconds",
        ),
        CrossFieldRule(
            cel="self.backoffSeconds <= self.maxBackoffSeconds",
            message="spec.health.backoffSeconds must not exceed spec.health.maxBackoffSeconds",
            check=lambda h: h.backoff_seconds <= h.max_backoff_seconds,
            field_path=".backoffSeconds",
        ),
    )


class AutoscalingSpec(ApiModel):
    """Replicas follow the driver's load (HPA formula: ceil(replicas * current / target))."""

    enabled: bool = Field(default=False, description="Let the operator set spec.replicas from the metric.")
    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="Fewest replicas.")
    max_replicas: int = Field(default=8, ge=1, le=MAX_REPLICAS, description="Most replicas.")
    metric: Literal["queueDepth", "inflight", "latencyP95Ms", "requestsWaiting", "kvCacheUsage"] = Field(
        default="queueDepth",
        description=(
            "Driver metric held near target: `queueDepth` (inputs queued) and `inflight` (requests admitted, not "
            "yet answered), summed over the drivers and divided by the replicas; `latencyP95Ms`, the 95th "
            "percentile request latency in ms between two scrapes, over all drivers; for `generate` groups `requestsWaiting` (requests the "
            "engines hold waiting for KV cache room, divided by the replicas) and `kvCacheUsage` (the share of "
            "KV cache blocks in use, 0 to 1, averaged over the serving replicas)."
        ),
    )
    target: float = Field(
        default=4.0,
        gt=0,
        le=1e6,
        description="Target value of the metric per replica; at most 1 for `kvCacheUsage` (a fraction).",
    )
    tolerance: float = Field(
        default=0.1, ge=0, lt=1, description="Relative deviation from target that causes no scaling."
    )
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Window whose lowest recommendation a scale-up uses."
    )
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=3600, description="Window whose highest recommendation a scale-down uses."
    )
    scale_to_zero_after_seconds: int = Field(
        default=300,
        ge=1,
        le=86400,
        description=(
            "With minReplicas 0: after this long with no request (none answered, in flight, queued or held by any "
            "driver), the autoscaler drains the replicas and sets replicas to 0 (Event ScaledToZero, phase "
            "Idle); the first request held by a driver brings one back (Event ScaledFromZero), with no "
            "stabilization window."
        ),
    )
    activation_timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=3600,
        description=(
            "With minReplicas 0: how long the driver holds a request while no replica serves (at most "
            "spec.driver.batching.maxQueue requests, beyond them 429) before answering 503; held requests are "
            "served in arrival order once a replica serves. The default is far above the example groups' "
            "cold start measured here (docs/operations.md). With minReplicas above 0 nothing is held: a request "
            "with no serving replica gets 503."
        ),
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="self.minReplicas <= self.maxReplicas",
            message="spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
            field_path=".minReplicas",
        ),
        CrossFieldRule(
            cel="self.metric != 'kvCacheUsage' || self.target <= 1.0",
            message=(
                "spec.autoscaling.target must be a fraction in (0, 1] when spec.autoscaling.metric is kvCacheUsage"
            ),
            check=lambda a: a.metric != "kvCacheUsage" or a.target <= 1.0,
            field_path=".target",
        ),
    )


class RolloutSpec(ApiModel):
    """How a change of worker image, env or world size is rolled out."""

    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description=(
            "Replicas (of replicas + maxSurge) that may be unavailable at the same time while a rollout replaces"
            " them; a replica being replaced is drained first, like a scale-down."
        ),
    )
    max_surge: int = Field(
        default=0,
        ge=0,
        le=MAX_REPLICAS,
        description=(
            "Extra replicas of the new revision a rollout starts first (at indices from replicas on), removed"
            " (drained) once every replica is replaced; 0 (GPUs are scarce) replaces in place. With 1 replica"
            " and maxSurge 1 the new replica serves before the old one is drained."
        ),
    )
    drain_timeout_seconds: int = Field(
        default=60,
        ge=0,
        le=600,
        description=(
            "When replicas are lowered (kubectl scale, an HPA, the autoscaler), how long the drivers may finish "
            "a leaving replica's in-flight batches before its pods are deleted; 0 deletes them at once."
        ),
    )


# ----------------------------------------------------------------------------------------------------- spec


class InferenceWorkerGroupSpec(ApiModel):
    """Desired state of an InferenceWorkerGroup."""

    model: ModelSpec = Field(description="The model every worker loads.")
    replicas: int = Field(
        default=1, ge=0, le=MAX_REPLICAS, description="Data-parallel replicas (the scale subresource)."
    )
    world_size: int = Field(
        default=1,
        ge=1,
        le=MAX_WORLD_SIZE,
        description=(
            "Ranks (pods) per replica for tensor parallelism: a replica's ranks hold one model sharded between "
            "them by transformers' tensor-parallel plan for its architecture (attention and MLP projections "
            "split across the ranks, gloo on CPU, nccl on CUDA), each about 1/worldSize of the weights; every "
            "rank runs every step of the replica's engine and rank 0 answers. A model whose architecture has "
            "no tensor-parallel plan (BERT, GPT-2), or whose attention heads, key/value heads or MLP "
            "intermediate size worldSize does not divide, is refused when its workers start, before any "
            "weight is read: the group's Degraded condition (reason WorkerFailed) names the architecture and "
            "the reason. There is no pipeline parallelism."
        ),
    )
    worker: WorkerSpec = Field(default_factory=WorkerSpec, description="Worker pods.")
    driver: DriverSpec = Field(default_factory=DriverSpec, description="The group's driver.")
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, description="Placement of worker pods."
    )
    health: HealthSpec = Field(default_factory=HealthSpec, description="Health checks and restarts.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Autoscaling.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rolling replacement.")

    @property
    def gang_enabled(self) -> bool:
        """Whether replicas are placed as gangs (spec.scheduling.gang, default: worldSize > 1)."""
        return self.world_size > 1 if self.scheduling.gang is None else self.scheduling.gang

    cross_field_rules = (
        CrossFieldRule(
            cel=(
                "!has(self.scheduling.gpusPerNode) || self.scheduling.gpusPerNode >= "
                "(self.scheduling.colocateRanks ? self.worldSize * self.worker.gpus : self.worker.gpus)"
            ),
            message=(
                "spec.worker.gpus (times spec.worldSize when spec.scheduling.colocateRanks) "
                "exceeds spec.scheduling.gpusPerNode"
            ),
            check=lambda s: (
                s.scheduling.gpus_per_node is None
                or s.scheduling.gpus_per_node
                >= (s.world_size * s.worker.gpus if s.scheduling.colocate_ranks else s.worker.gpus)
            ),
            field_path=".worker.gpus",
        ),
        CrossFieldRule(
            cel="!has(self.scheduling.gpuProduct) || self.worker.gpus > 0",
            message="spec.scheduling.gpuProduct needs spec.worker.gpus > 0",
            check=lambda s: s.scheduling.gpu_product is None or s.worker.gpus > 0,
            field_path=".scheduling.gpuProduct",
        ),
    )


# --------------------------------------------------------------------------------------------------- status


class Condition(ApiModel):
    """A status condition (Ready, Progressing, Degraded, Unschedulable, SpecInvalid)."""

    type: str = Field(max_length=64, description="Condition type.")
    status: Literal["True", "False", "Unknown"] = Field(description="Condition status.")
    reason: str = Field(default="", max_length=128, description="Machine-readable reason, CamelCase.")
    message: str = Field(default="", max_length=4096, description="Human-readable details.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition is for."
    )


class ReplicaStatus(ApiModel):
    """Summary of one data-parallel replica."""

    index: int = Field(ge=0, description="Replica index.")
    pods: int = Field(default=0, ge=0, description="Pods that exist for this replica.")
    ready_pods: int = Field(default=0, ge=0, description="Pods of this replica that are ready.")
    ready: bool = Field(default=False, description="All ranks exist, run the current revision and are ready.")
    revision: str = Field(default="", description="Pod template revision of this replica's pods.")
    nodes: list[str] = Field(default_factory=list, description="Nodes the replica's pods are bound to.")
    gang: Literal["Placed", "Waiting"] | None = Field(
        default=None,
        description=(
            "With gang placement: Placed once the scheduler bound the replica's PodGroup, Waiting before "
            "(gangMessage says why)."
        ),
    )
    gang_message: str | None = Field(
        default=None, description="The scheduler's message on a waiting replica's PodGroup."
    )


class AvoidedNode(ApiModel):
    """A node where a worker reported a device fault: the group's new pods stay off it for a while."""

    node: str = Field(description="Node name (kubernetes.io/hostname).")
    since: str = Field(
        description="When the fault was seen (RFC 3339); the node is avoided for an hour after."
    )


class RecentRestart(ApiModel):
    """A replacement by the health prober that the restart budget still counts."""

    time: str = Field(description="When the pod or replica was replaced (RFC 3339).")
    replica: int = Field(ge=0, description="The replica replaced (or whose pod was).")


class ActivationPhases(ApiModel):
    """An activation's time to first answer in its parts, each starting where the one before ends (they add up
    to `seconds`), from what the serving replica's worker said of its start."""

    pod_start: float = Field(
        ge=0,
        description="First request held to the worker process's start: scheduling, image pull, container.",
    )
    worker_start: float = Field(
        ge=0, description="Worker process start to its model load's start: imports, device."
    )
    model_load: float = Field(ge=0, description="The model's load (weights, engine).")
    ready: float = Field(
        ge=0, description="Model loaded to replica serving: sockets, hello, the driver reaching it."
    )
    first_answer: float = Field(
        ge=0, description="Replica serving to the first answer: its first batch or step."
    )


class LastActivation(ApiModel):
    """The group's latest activation from zero, as its drivers measured it."""

    at: str = Field(description="When the first held request was answered (RFC 3339).")
    seconds: float = Field(
        ge=0,
        description=(
            "Time to first answer: from the first request a driver held with no replica serving to the first "
            "answer of a held request."
        ),
    )
    phases: ActivationPhases | None = Field(
        default=None,
        description="The same time in its parts; absent where the worker did not say how it started.",
    )


class InferenceWorkerGroupStatus(ApiModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(extra="allow")

    phase: Literal["Pending", "Progressing", "Running", "Idle", "Degraded", "Failed"] | None = Field(
        default=None,
        description="Pending, Progressing, Running, Idle (scaled to zero replicas, none left), Degraded or Failed.",
    )
    replicas: int | None = Field(default=None, ge=0, description="Replicas that have at least one pod.")
    ready_replicas: int | None = Field(default=None, ge=0, description="Replicas whose ranks are all ready.")
    updated_replicas: int | None = Field(default=None, ge=0, description="Replicas at the current revision.")
    world_size: int | None = Field(default=None, description="World size of the current revision.")
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (scale subresource)."
    )
    revision: str | None = Field(default=None, description="Current pod template revision.")
    observed_generation: int | None = Field(default=None, description="Last metadata.generation acted upon.")
    replica_statuses: list[ReplicaStatus] = Field(default_factory=list, description="Per-replica summary.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, ...")
    restart_count: int | None = Field(
        default=None, ge=0, description="Pods or replicas replaced by the prober."
    )
    recent_restarts: list[RecentRestart] = Field(
        default_factory=list,
        description=(
            "The prober's replacements within spec.health.restartWindowSeconds (the newest 128), oldest first: "
            "the restart budget and each replica's backoff count them, also after an operator restart."
        ),
    )
    scale_count: int | None = Field(default=None, ge=0, description="Times the autoscaler changed replicas.")
    last_scale_time: str | None = Field(
        default=None, description="When the autoscaler last changed replicas."
    )
    last_activation: LastActivation | None = Field(
        default=None,
        description=(
            "The latest activation from zero (scale from zero, or a start with requests held): written by the "
            "autoscaler (spec.autoscaling.enabled) from the drivers' metrics, with an Event ActivatedFromZero."
        ),
    )
    avoided_nodes: list[AvoidedNode] = Field(
        default_factory=list,
        description=(
            "Nodes where a worker reported a device fault in the last hour (at most 16, newest kept): new pods "
            "get a required node anti-affinity to them, also after an operator restart."
        ),
    )
    engine: str | None = Field(
        default=None,
        description=(
            "Generation engine the group's workers run (`vllm` or `transformers`), as their health checks "
            "report it (spec.model.engine `auto` resolved per worker). While workers disagree (a rollout that "
            "changes the engine, or an `auto` group on mixed images) every engine seen, sorted and joined by "
            "commas (`transformers,vllm`). Unset for task `embed` and while no worker has answered a health check."
        ),
    )


# ------------------------------------------------------------------------------------------------ top level


class ObjectMeta(BaseModel):
    """The parts of metadata the group needs; everything else is kept as given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=MAX_GROUP_NAME_LENGTH, pattern=DNS_LABEL_PATTERN)
    namespace: str = Field(default="default", min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceWorkerGroup(BaseModel):
    """A group of model-inference workers: `replicas` data-parallel replicas of `worldSize` ranks each."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    api_version: Literal["inference.iwg.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceWorkerGroup"]
    metadata: ObjectMeta
    spec: InferenceWorkerGroupSpec
    status: InferenceWorkerGroupStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.metadata.name


# ----------------------------------------------------------------------------------------------- loading


class ManifestError(ValueError):
    """A manifest that is not a valid InferenceWorkerGroup; `errors` are (field path, message) pairs."""

    def __init__(self, source: str, errors: list[tuple[str, str]]) -> None:
        self.source = source
        self.errors = errors
        lines = "\n".join(f"  {path}: {message}" for path, message in errors)
        super().__init__(f"invalid InferenceWorkerGroup {source}:\n{lines}")


def _field_path(loc: tuple[int | str, ...], prefix: tuple[str, ...] = ()) -> str:
    path = ""
    for part in (*prefix, *loc):
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "(root)"


def format_validation_error(error: ValidationError, prefix: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Turn pydantic's errors into (manifest field path, message) pairs, e.g. ('spec.worker.gpus', ...)."""
    result: list[tuple[str, str]] = []
    for item in error.errors():
        path = _field_path(tuple(item["loc"]), prefix)
        nested = (item.get("ctx") or {}).get("error")
        if isinstance(nested, NestedFieldErrors):
            result.extend((path + inner, message) for inner, message in nested.problems)
            continue
        message = str(item["msg"]).removeprefix("Value error, ")
        result.append((path, message))
    return result


def parse_spec(spec: Mapping[str, Any]) -> InferenceWorkerGroupSpec:
    """Validate a group's `spec` (as the operator receives it); errors name fields as `spec.<...>`."""
    try:
        return InferenceWorkerGroupSpec.model_validate(dict(spec))
    except ValidationError as error:
        raise ManifestError("spec", format_validation_error(error, ("spec",))) from None


def load_manifest(source: str | Path | Mapping[str, Any]) -> InferenceWorkerGroup:
    """Load and validate a full InferenceWorkerGroup manifest from a YAML file path or a dict.

    Raises ManifestError whose message lists every bad field by its manifest path (`spec.worker.gpus: ...`).
    A YAML file must hold exactly one document.
    """
    if isinstance(source, Mapping):
        label, data = "manifest", dict(source)
    else:
        label = str(source)
        try:
            documents = [d for d in yaml.safe_load_all(Path(source).read_text()) if d is not None]
        except OSError as error:
            raise ManifestError(label, [("(file)", error.strerror or str(error))]) from None
        except yaml.YAMLError as error:
            raise ManifestError(label, [("(yaml)", str(error))]) from None
        if len(documents) != 1:
            raise ManifestError(label, [("(file)", f"expected one YAML document, found {len(documents)}")])
        data = documents[0]
        if not isinstance(data, dict):
            raise ManifestError(label, [("(root)", "expected a mapping")])
    try:
        return InferenceWorkerGroup.model_validate(data)
    except ValidationError as error:
        raise ManifestError(label, format_validation_error(error)) from None
