"""A radix tree over token ids whose values are KV slots: the prompts' prefixes the engine keeps computed.

graphrt's KV pool is token-granular (a slot per token per full-attention layer), so the cache is keyed
token by token, as SGLang's RadixAttention (``mem_cache/radix_cache.py``) keys its own: each edge holds
a run of token ids and the slots their keys and values live in. ``match`` finds the longest cached
prefix of a sequence (splitting an edge where the match ends inside it), ``insert`` adds what a
sequence has beyond what is cached, ``lock``/``unlock`` count the running requests that read a node and
its ancestors (a locked node is never evicted), ``evict`` frees the least recently used unlocked
leaves. Pure Python over ints: it knows nothing of devices or requests (graphrt.hf.prefix_sharing
ties it to the engine's slot table).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


def common_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading token ids ``first`` and ``second`` share."""
    length = min(len(first), len(second))
    if first[:length] == second[:length]:  # the common case at C speed: the whole run matches
        return length
    return next(index for index in range(length) if first[index] != second[index])


@dataclass(eq=False)
class PrefixNode:
    """One edge of the tree: its token ids, the KV slots of those tokens, its parent and children (by
    first token id), how many running requests read it and when it was last used (a tick of its tree)."""

    tokens: List[int]
    slots: List[int]
    parent: Optional["PrefixNode"]
    children: Dict[int, "PrefixNode"] = field(default_factory=dict)
    locks: int = 0
    last_used: int = 0

    def __lt__(self, other: "PrefixNode") -> bool:  # heapq: the least recently used first
        return self.last_used < other.last_used


class PrefixCache:
    """The radix tree and its sizes in tokens: ``cached_tokens`` (every slot it holds), ``evictable_tokens``
    (held by nodes no running request reads), ``evicted_tokens`` (freed by ``evict`` so far)."""

    def __init__(self) -> None:
        self.root = PrefixNode([], [], None, locks=1)  # never evicted, never counted
        self._ticks = itertools.count(1)
        self.cached_tokens = 0
        self.evictable_tokens = 0
        self.evicted_tokens = 0  # over the cache's life

    def match(self, tokens: Sequence[int]) -> Tuple[List[int], PrefixNode]:
        """The slots of the longest cached prefix of ``tokens`` and the node it ends at (an edge the match
        ends inside is split there, so the node covers exactly the match); every node on the way is used now."""
        node, slots, start, tick = self.root, [], 0, next(self._ticks)
        while start < len(tokens):
            child = node.children.get(tokens[start])
            if child is None:
                break
            shared = common_length(child.tokens, tokens[start:start + len(child.tokens)])
            if shared < len(child.tokens):
                child = self._split(child, shared)
            child.last_used = tick
            slots.extend(child.slots)
            node, start = child, start + shared  # after a split, no child of ``node`` begins with the next token
        return slots, node

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``tokens`` with their ``slots``: how many leading tokens were cached already (their slots in
        ``slots`` stay the caller's); the slots of the rest are the cache's from now on."""
        if len(tokens) != len(slots):
            raise ValueError(f"slots: expected one slot per token ({len(tokens)}), got {len(slots)}")
        matched, node = self.match(tokens)
        cached = len(matched)
        if cached < len(tokens):
            child = PrefixNode(list(tokens[cached:]), list(slots[cached:]), node, last_used=next(self._ticks))
            node.children[tokens[cached]] = child
            self.cached_tokens += len(child.tokens)
            self.evictable_tokens += len(child.tokens)
        return cached

    def lock(self, node: PrefixNode) -> None:
        """A running request reads ``node`` and its ancestors: none of them is evicted until ``unlock``."""
        while node is not self.root:
            if node.locks == 0:
                self.evictable_tokens -= len(node.tokens)
            node.locks += 1
            node = node.parent

    def unlock(self, node: PrefixNode) -> None:
        """Undo one ``lock(node)``."""
        while node is not self.root:
            if node.locks <= 0:
                raise RuntimeError("PrefixCache.unlock: the node is not locked")
            node.locks -= 1
            if node.locks == 0:
                self.evictable_tokens += len(node.tokens)
            node = node.parent

    def evict(self, tokens: int) -> List[int]:
        """Free at least ``tokens`` slots (fewer when not that many are evictable): unlocked leaves, least
        recently used first; a parent left without children is a leaf in its turn. The freed slots."""
        leaves = [node for node in self._nodes() if not node.children and node.locks == 0]
        heapq.heapify(leaves)
        freed: List[int] = []
        while leaves and len(freed) < tokens:
            node = heapq.heappop(leaves)
            freed.extend(node.slots)
            parent = node.parent
            del parent.children[node.tokens[0]]
            self.cached_tokens -= len(node.tokens)
            self.evictable_tokens -= len(node.tokens)
            self.evicted_tokens += len(node.tokens)
            if parent is not self.root and not parent.children and parent.locks == 0:
                heapq.heappush(leaves, parent)
        return freed

    def clear(self) -> List[int]:
        """Every slot the cache holds, the tree emptied; RuntimeError while a running request reads it."""
        if self.evictable_tokens != self.cached_tokens:
            raise RuntimeError("PrefixCache.clear: running requests read cached prefixes")
        freed = [slot for node in self._nodes() for slot in node.slots]
        self.root.children.clear()
        self.cached_tokens = self.evictable_tokens = 0
        return freed

    def _split(self, node: PrefixNode, length: int) -> PrefixNode:
        """``node`` cut after ``length`` tokens: the new parent holding the first part (its locks and use are
        ``node``'s: whoever read ``node`` reads it too), ``node`` keeping the rest below it."""
        head = PrefixNode(node.tokens[:length], node.slots[:length], node.parent, locks=node.locks,
                          last_used=node.last_used)
        node.parent.children[head.tokens[0]] = head
        node.tokens, node.slots, node.parent = node.tokens[length:], node.slots[length:], head
        head.children[node.tokens[0]] = node
        return head

    def _nodes(self) -> List[PrefixNode]:
        """Every node but the root."""
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found


__all__ = ["PrefixCache", "PrefixNode", "common_length"]
