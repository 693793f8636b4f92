"""What the driver knows of the replicas' prefix caches: the prompts it sent where, as hashes of blocks.

An engine with prefix caching keeps a prompt's KV cache in fixed-size blocks and skips the prefill of the
blocks it already holds. The driver records, per replica, the block hashes of every generation prompt it
sent there (`PrefixTable`) and routes a new prompt to the replica holding the longest run of its leading
blocks (`Router.pick_generation`).

The driver does not tokenize: the worker does, and tokenizing again here cost about 1.1 ms for a 620-token
chat prompt (SmolLM2's fast tokenizer, this machine), above the 1 ms a routing decision may add. A prompt is
hashed as the worker receives it: token-id prompts in blocks of the engine's block size, text prompts and chat
messages in blocks of ``CHARS_PER_TOKEN`` x block size characters (about one engine block of English text).
Each block's hash chains its predecessor's, so equal hashes mean equal prefixes. Only full blocks count, as
in the engines' caches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
DEFAULT_BLOCK_SIZE = 16  # until a replica reports its engine's
DEFAULT_MAX_BLOCKS = 32_768  # remembered per replica (least recently used forgotten first)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's chained block hashes (full blocks only) and its anchor: the hash of its first block, or of
    the whole prompt when shorter than a block (what rendezvous hashing ranks the replicas by)."""

    hashes: tuple[int, ...]
    anchor: int


def _digest(parent: int, data: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(data)
    return int.from_bytes(h.digest(), "little")


def prompt_blocks(request: dict[str, Any], block_size: int) -> PromptBlocks | None:
    """The blocks of a generation request's prompt (`prompt`, `prompt_ids` or chat `messages`), None when it
    has none of them."""
    data: bytes
    step: int
    if isinstance(request.get("prompt_ids"), list):
        data = array("q", request["prompt_ids"]).tobytes()
        step = block_size * 8
    elif isinstance(request.get("prompt"), str):
        data = request["prompt"].encode("utf-8", "surrogatepass")
        step = block_size * CHARS_PER_TOKEN
    elif isinstance(request.get("messages"), list):
        # One separator no text holds between role and content, another after each message: a chat's next
        # turn (the same messages and more) continues the same bytes.
        data = "".join(f"{m.get('role')}\x00{m.get('content')}\x1e" for m in request["messages"]).encode(
            "utf-8", "surrogatepass"
        )
        step = block_size * CHARS_PER_TOKEN
    else:
        return None
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(data) - step + 1, step):
        parent = _digest(parent, data[start : start + step])
        hashes.append(parent)
    anchor = hashes[0] if hashes else _digest(0, data)
    return PromptBlocks(tuple(hashes), anchor)


def rendezvous_weight(anchor: int, replica: int) -> int:
    """Highest-random-weight hashing: every driver ranks the replicas alike for the same anchor, and a
    replica leaving moves only the anchors it ranked first."""
    return _digest(anchor, replica.to_bytes(4, "little"))


class PrefixTable:
    """Per replica, the block hashes of the prompts sent there, least recently used forgotten first beyond
    ``max_blocks``. A prompt's blocks are recorded last block first, so a prompt's first blocks are the most
    recent of its own and are forgotten after its later ones (a later block without its predecessors matches
    nothing)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[int, OrderedDict[int, None]] = {}

    def match(self, replica: int, hashes: Iterable[int]) -> int:
        """How many of the leading blocks `replica` holds."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def record(self, replica: int, hashes: tuple[int, ...]) -> None:
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def discard(self, replica: int, hashes: Iterable[int]) -> None:
        """`replica` no longer holds the blocks `hashes` (its engine evicted them)."""
        held = self._blocks.get(replica)
        if held:
            for h in hashes:
                held.pop(h, None)

    def forget(self, replica: int) -> None:
        self._blocks.pop(replica, None)

    def clear(self) -> None:
        self._blocks.clear()

    def size(self, replica: int) -> int:
        return len(self._blocks.get(replica, ()))
