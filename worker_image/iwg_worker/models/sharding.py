"""Tensor parallelism for a replica of ``worldSize`` N: whether a model can be sharded N ways, and how.

A replica's ranks hold one model between them, sharded by transformers' own tensor-parallel loading
(``DistributedConfig(tp_size=N)``) along the plan the model's architecture ships (``base_model_tp_plan``:
attention projections by heads, MLP projections by columns and rows, one all-reduce after each). A model is
never served unsharded on several ranks: `check_shardable` refuses, before any weight is read, an architecture
without a plan, and a world size that does not divide the attention and key/value heads (and the MLP's
intermediate size) evenly.
"""

from __future__ import annotations

import math
from typing import Any


class ShardingRefused(ValueError):
    """The model cannot be sharded ``world_size`` ways; the message names the architecture and the reason."""


def architecture(config: Any) -> str:
    """The model's class as its configuration names it (``LlamaForCausalLM``), else its ``model_type``."""
    names = getattr(config, "architectures", None) or []
    return str(names[0]) if names else str(getattr(config, "model_type", "unknown"))


def tp_plan(config: Any) -> dict[str, str]:
    """The architecture's tensor-parallel plan (module pattern -> style); empty when it has none."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    return dict(plan) if plan else {}


def _sharded_sizes(config: Any) -> list[tuple[str, int]]:
    """The sizes the plan splits across ranks, each of which the world size must divide."""
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    sizes = [
        ("attention heads", heads),
        ("key/value heads", int(getattr(text, "num_key_value_heads", None) or heads)),
    ]
    intermediate = getattr(text, "intermediate_size", None)
    if isinstance(intermediate, int) and intermediate > 0:
        sizes.append(("MLP intermediate size", intermediate))
    return sizes


def dividing_world_sizes(config: Any) -> list[int]:
    """Every world size that shards ``config``'s model evenly (1 always does)."""
    common = math.gcd(*(size for _, size in _sharded_sizes(config)))
    return [n for n in range(1, common + 1) if common % n == 0]


def check_shardable(config: Any, world_size: int) -> None:
    """Raise `ShardingRefused` unless ``world_size`` ranks can each hold 1/world_size of the model."""
    if world_size <= 1:
        return
    name = architecture(config)
    if not tp_plan(config):
        raise ShardingRefused(
            f"worldSize {world_size}: architecture {name} has no tensor-parallel plan in transformers, so its "
            "weights cannot be sharded across ranks; iwg does not serve a model unsharded on several ranks: "
            "use worldSize 1 (and more replicas for throughput)"
        )
    sizes = _sharded_sizes(config)
    uneven = [(what, size) for what, size in sizes if size % world_size]
    if uneven:
        listed = ", ".join(f"{size} {what}" if "heads" in what else f"{what} {size}" for what, size in sizes)
        allowed = ", ".join(str(n) for n in dividing_world_sizes(config))
        raise ShardingRefused(
            f"worldSize {world_size} cannot shard architecture {name}: it has {listed}, and each must divide "
            f"evenly across the ranks; world sizes that divide them all: {allowed}"
        )


def load_config(directory: Any, **pretrained_kwargs: Any) -> Any:
    """The model's transformers configuration (no weights read)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory, **pretrained_kwargs)


def distributed_kwargs(world_size: int) -> dict[str, Any]:
    """``from_pretrained`` options that shard the model over the replica's process group (none for 1 rank)."""
    if world_size <= 1:
        return {}
    from transformers.distributed.configuration_utils import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=world_size)}


def local_parameter_bytes(model: Any) -> int:
    """Bytes of the parameters this rank holds (its shards, not the whole model)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return int(total)
