"""Shared prompt prefixes computed once: the engine's prefix cache tied to its slot table and scheduler.

``EnginePrefixes`` is the engine's side: whether its model may share at all (a layer that keeps its
keys and values in a ring of its own per request row cannot: the ring is recycled as the window
slides and is not in the shared pool; rotary frequencies that depend on a request's length would
make a cached prefix's keys another request's), the ``PrefixCache`` kept across calls, and when it
goes stale (the model's parameters and buffers rebound or written in place since it was filled,
the pools made anew, ``recapture()``, ``reset_prefix_cache()``).

``PrefixSharing`` is one ``serve()``'s side, called by the scheduler (graphrt.hf.serve): a request's
first prefill chunk starts after the longest cached prefix of its prompt (all but its last token,
whose logits it needs), which its request row points at and which stays locked while it runs; a
request that shares more of its prompt with one that is still computing it waits for it (as SGLang's
in-batch prefix check does), so 32 requests with one system prompt compute it once; each step's
computed prompt tokens are cached as soon as they are launched (a later step reads them in stream
order), and a finished request caches its prompt and output. Tokens are those of computing every
prompt in full: a cached prefix holds the keys and values of the same tokens at the same positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from graphrt.hf.engine_slots import SlotTable
from graphrt.hf.kv_layout import KVLayout
from graphrt.hf.prefix_cache import PrefixCache, PrefixNode, common_length
from graphrt.hf.serve import Request, ServeCounts

logger = logging.getLogger(__name__)

# a request row, the first position, the prompt ids there: the token history of a shared prefix
WriteIds = Callable[[int, int, Sequence[int]], None]


def sharing_refusal(layout: KVLayout, length_dependent_rope: bool) -> Optional[str]:
    """Why a model of ``layout`` cannot share prefixes, or None."""
    for index, layer in enumerate(layout.layers):
        if layer.ring and layout.stores(index):
            return (f"layer {index} keeps its sliding window of {layer.window} in a ring of {layer.ring} slots per "
                    f"request row (recycled as the window slides, not in the shared pool)")
    if length_dependent_rope:
        return "its rotary frequencies depend on each request's length (a cached prefix's keys would be another's)"
    return None


def weights_signature(model: torch.nn.Module) -> Tuple[Any, ...]:
    """What says the model's parameters and buffers are the ones a cached prefix was computed with: each
    tensor's identity, memory and version counter (bumped by every in-place write through it)."""
    return tuple((id(tensor), tensor.data_ptr(), _version(tensor))
                 for tensors in (model.parameters(), model.buffers()) for tensor in tensors)


def _version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (-1 for an inference tensor, which has none: its identity and memory only)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


class EnginePrefixes:
    """The engine's prefix cache (None when sharing is off or refused, with ``reason``) and its staleness."""

    def __init__(self, enabled: bool, layout: KVLayout, length_dependent_rope: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"prefix_sharing: expected a bool, got {enabled!r}")
        self.reason = "turned off (prefix_sharing=False)" if not enabled else sharing_refusal(
            layout, length_dependent_rope)
        self.cache: Optional[PrefixCache] = None if self.reason else PrefixCache()
        self._signature: Optional[Tuple[Any, ...]] = None

    def describe(self) -> str:
        return "on" if self.cache is not None else f"off: {self.reason}"

    def for_call(self, model: torch.nn.Module, slots: SlotTable, counts: ServeCounts,
                 write_ids: Optional[WriteIds]) -> Optional["PrefixSharing"]:
        """The scheduler's hooks for one call (None when sharing is off), the cache emptied first when the
        model's parameters or buffers moved since it was filled."""
        if self.cache is None:
            return None
        signature = weights_signature(model)
        if signature != self._signature:
            if self.cache.cached_tokens:
                logger.info("engine: the model's parameters or buffers changed since the prefix cache was filled: "
                            "%d cached tokens dropped", self.cache.cached_tokens)
            slots.clear_prefixes()
            self._signature = signature
        return PrefixSharing(slots, self.cache, counts, write_ids)

    def stats(self) -> Dict[str, Any]:
        cache = self.cache
        return {"enabled": cache is not None, "reason": self.reason,
                "cached_tokens": cache.cached_tokens if cache else 0,
                "evictable_tokens": cache.evictable_tokens if cache else 0,
                "evicted_tokens": cache.evicted_tokens if cache else 0}


@dataclass
class _Shared:
    """A running request's cached prefix: the node it locked and the slots its row's first positions point at."""

    node: PrefixNode
    slots: List[int]


class PrefixSharing:
    """The scheduler's hooks for one ``serve()`` (graphrt.hf.serve.ServeLoop): ``ready`` before a prefill
    chunk, ``refresh`` before each step is scheduled, ``finish`` for a request done, ``drop`` for every
    request released."""

    def __init__(self, slots: SlotTable, cache: PrefixCache, counts: ServeCounts,
                 write_ids: Optional[WriteIds] = None) -> None:
        self.slots = slots
        self.cache = cache
        self.counts = counts
        self.write_ids = write_ids
        self._shared: Dict[int, _Shared] = {}  # by request row
        self._filling: Dict[int, Request] = {}  # started requests whose prompt is not all cached, by row

    def ready(self, request: Request) -> bool:
        """Whether ``request`` runs a prefill chunk in this step. Its first: it waits while a request that
        started before it computes more of its prompt than is cached; else it starts after the longest
        cached prefix of its prompt but the last token (its row points at it, locked while it runs)."""
        if request.row in self._shared:
            return True
        prompt = request.prompt
        limit = len(prompt) - 1
        slots, node = self.cache.match(prompt[:limit])
        for other in self._filling.values():
            started = self._shared[other.row]
            if len(started.slots) < limit:
                coming = min(common_length(other.prompt, prompt), limit)
                if coming > len(slots) and len(started.slots) < coming:
                    return False
        if slots:
            self.cache.lock(node)
            self.slots.share(request.row, slots)
            request.cached = request.assigned = len(slots)
            self.counts.prefix_tokens_reused += len(slots)
            self.counts.prefix_requests += 1
            if self.write_ids is not None:
                self.write_ids(request.row, 0, prompt[:len(slots)])
        self._shared[request.row] = _Shared(node, slots)
        self._filling[request.row] = request
        return True

    def refresh(self) -> None:
        """Cache the prompt tokens every started request had computed in the steps launched so far (a loop over
        the requests still prefilling: none in a step of decodes only)."""
        for row, request in list(self._filling.items()):
            shared, computed = self._shared[row], min(request.cached, len(request.prompt))
            if len(shared.slots) < computed:
                self._cache(request, shared, request.prompt, computed)
            if computed == len(request.prompt):
                del self._filling[row]

    def finish(self, request: Request) -> None:
        """Cache a finished request's prompt and output, as far as their keys and values were computed."""
        shared = self._shared.get(request.row)
        if shared is not None:
            sequence = request.prompt + request.output
            self._cache(request, shared, sequence, min(request.cached, len(sequence)))

    def drop(self, request: Request) -> None:
        """``request`` releases its row: its cached prefix unlocked (evictable once no one else reads it)."""
        shared = self._shared.pop(request.row, None)
        self._filling.pop(request.row, None)
        if shared is not None:
            self.cache.unlock(shared.node)

    def _cache(self, request: Request, shared: _Shared, sequence: List[int], count: int) -> None:
        """Cache the first ``count`` tokens of ``sequence``, whose keys and values ``request``'s row holds: its own
        slots the cache did not have become the cache's, the ones it had are freed (the row points at the
        cache's instead), and the request's lock moves to the longer prefix."""
        row, start = request.row, len(shared.slots)
        cached_before = self.cache.insert(sequence[:count], shared.slots + self.slots.owned(row)[:count - start])
        slots, node = self.cache.match(sequence[:count])
        if cached_before > start:
            self.slots.share(row, slots[start:cached_before])
        self.slots.adopt(row, count - max(cached_before, start))
        self.cache.lock(node)
        self.cache.unlock(shared.node)
        shared.node, shared.slots = node, slots


__all__ = ["EnginePrefixes", "PrefixSharing", "sharing_refusal", "weights_signature"]
