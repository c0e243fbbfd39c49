"""Graph-safe sliding-window cache layers: the state on the device, nothing a replay must redo on the host.

transformers' ``StaticSlidingWindowLayer`` (5.x) counts the tokens it has seen twice: a device
tensor (``cumulative_length``) and a Python int (``cumulative_length_int``). ``update()`` advances
the int and branches on it: while the window fills it writes at the tensor count; once full, it
rolls the window left by one and writes the last slot; a multi-token step past the window
returns ``cat(cached, new)``. ``get_mask_sizes()`` derives the mask's ``(kv_length, kv_offset)``
from the int. Under ``torch.compile`` dynamo guards on the int and recompiles when the branch
changes; a CUDA graph replays neither the increment nor the branch, so graphrt refuses it
(``RebindError``).

The layers here answer the same questions with no Python state that a step changes:

* ``SlidingRingLayer`` (a window shorter than the cache): a ring of ``window`` slots, position
  ``p`` in slot ``p % window``, the count only on the device. A step writes its tokens at their
  slots and returns the visible positions ``[offset, offset + window - 1 + new)`` in position
  order, gathered with indices computed on the device; which ops run depends on the number of
  new tokens only (a shape), so one graph serves the filling and the full window alike. The
  mask sizes are ``(window - 1 + new, max(count - window + 1, 0))``: for a decode step the
  same as transformers' (the same keys in the same order); for a multi-token step the trailing
  slots past the last new token are masked as future positions. ``get_mask_sizes()`` reads the
  count on the host: generate() calls it while building the mask, outside the model call, once
  its per-step stop check has synchronized; inside a recorded step that read is a host sync,
  which fails the capture rather than freezing a value.
* ``CacheLongWindowLayer`` (a window that cannot slide before the cache is full: as long as the
  cache's full-attention layers, which run out of room first, or configured longer than the cache):
  transformers' ``StaticLayer`` (count on the device, writes at it), flagged ``is_sliding``.

``replacement_mismatch()`` runs transformers' layer and the replacement side by side on a short
scripted sequence (filling, sliding, multi-token steps) and says where they differ, so a
transformers release that changes the layer's contract turns the replacement off instead of
changing the tokens.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from graphrt.backends.op_graph import HostSyncError
from graphrt.backends.source_lines import model_source_line

# Token counts per update of the scripted comparison, window 3: a prompt shorter than the window,
# decode steps that fill it and slide it, a multi-token step while full; then a prompt longer
# than the window followed by decode steps.
SCRIPTS = ((2, 1, 1, 1, 2, 1), (5, 1, 1))
SCRIPT_WINDOW = 3


class SlidingRingLayer(StaticLayer):
    """A sliding-window layer shorter than the cache: a ring of ``max_cache_len`` slots (the window)."""

    is_sliding = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens into the ring and return the visible positions in position order."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        window = self.max_cache_len
        count = self.cumulative_length  # tokens before this step, on the device
        first = (count - (window - 1)).clamp(min=0)  # the first visible position: get_mask_sizes()' offset
        positions = first + torch.arange(window - 1 + new, device=self.device)
        if new == 1:
            # The ring still holds every visible position after the write: write, then read in order.
            self._write(count, key_states, value_states)
            slots = positions.remainder(window)
            return self.keys.index_select(2, slots), self.values.index_select(2, slots)
        # Several new tokens may overwrite positions the first of them still sees: read, then write.
        cached = positions < count
        fresh = (positions - count).clamp(max=new - 1)  # trailing future slots repeat the last token (masked)
        slots = torch.where(cached, positions.remainder(window), window + fresh)
        keys = torch.cat((self.keys, key_states), dim=2).index_select(2, slots)
        values = torch.cat((self.values, value_states), dim=2).index_select(2, slots)
        self._write(count, key_states, value_states)
        return keys, values

    def _write(self, count: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the last ``min(new, window)`` new tokens at their slots and advance the count."""
        new = key_states.shape[-2]
        kept = min(new, self.max_cache_len)
        slots = (count + torch.arange(new - kept, new, device=self.device)).remainder(self.max_cache_len)
        self.keys.index_copy_(2, slots, key_states[:, :, new - kept:])
        self.values.index_copy_(2, slots, value_states[:, :, new - kept:])
        self.cumulative_length.add_(new)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        """``(kv_length, kv_offset)`` of what ``update`` returns; reads the token count on the host, which
        inside a captured step fails the capture with the remedy that works (masks built outside)."""
        if _capturing():
            where = model_source_line()
            raise HostSyncError(
                f"host sync in the captured step: SlidingRingLayer.get_mask_sizes{f' at {where}' if where else ''}: "
                "it reads the sliding window's fill count on the host, because the model builds its attention mask "
                "inside the step. Build the masks outside the step and pass them: "
                "attention_mask=graphrt.hf.decode_masks(model, cache)(position_ids), as generate() does under "
                "graphrt.hf.graph_generate")
        count = int(self.cumulative_length)
        return self.max_cache_len - 1 + query_length, max(count - self.max_cache_len + 1, 0)


def _capturing() -> bool:
    """Whether a graph is being captured (graphrt's CPU recorder answers as a CUDA capture does)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a torch built without CUDA, outside graphrt's recorder
        return False


class CacheLongWindowLayer(StaticLayer):
    """A sliding-window layer that cannot slide before the cache is full: a StaticLayer that says it is sliding."""

    is_sliding = True


def replacement_mismatch(make_ours: Callable[[int], StaticLayer], window: int, cache_length: int,
                         scripts: Sequence[Sequence[int]]) -> Optional[str]:
    """Where ``make_ours(max_cache_len)`` answers otherwise than transformers' StaticSlidingWindowLayer
    on ``scripts`` (token counts per update), or None. Compared per step: the mask offset (and for one
    new token the mask length), the sequence length, and the keys and values at every position the
    mask can show; the replacement must also return as many positions as its own mask length."""
    generator = torch.Generator().manual_seed(0)
    for script in scripts:
        try:
            theirs = StaticSlidingWindowLayer(max_cache_len=cache_length, sliding_window=window)
            ours = make_ours(theirs.max_cache_len)
        except Exception as error:  # a constructor that changed
            return f"building the layers failed: {type(error).__name__}: {error}"
        seen = 0
        for new in script:
            step = f"update of {new} token(s) after {seen}"
            keys, values = (torch.randn(1, 1, new, 2, generator=generator) for _ in range(2))
            their_sizes, our_sizes = theirs.get_mask_sizes(new), ours.get_mask_sizes(new)
            our_length = our_sizes[0]
            if their_sizes[1] != our_sizes[1] or (new == 1 and their_sizes != our_sizes):
                return f"{step}: mask sizes {their_sizes}, the replacement's {our_sizes}"
            their_kv, our_kv = theirs.update(keys, values), ours.update(keys, values)
            if our_kv[0].shape[2] != our_length:
                return f"{step}: the replacement returns {our_kv[0].shape[2]} positions for a mask of {our_length}"
            seen += new
            visible = seen - our_sizes[1]
            for name, mine, other in zip(("keys", "values"), our_kv, their_kv):
                if not torch.equal(mine[:, :, :visible], other[:, :, :visible]):
                    return f"{step}: the {name} returned for the visible positions differ"
            if int(theirs.get_seq_length()) != int(ours.get_seq_length()) or seen != int(ours.get_seq_length()):
                return f"{step}: sequence length {int(theirs.get_seq_length())}, the replacement's " \
                       f"{int(ours.get_seq_length())}"
    return None


@lru_cache(maxsize=None)
def ring_mismatch() -> Optional[str]:
    """``replacement_mismatch`` of SlidingRingLayer (a cache longer than the window), once per process."""
    return replacement_mismatch(lambda length: SlidingRingLayer(max_cache_len=length), SCRIPT_WINDOW, 16, SCRIPTS)


@lru_cache(maxsize=None)
def cache_long_mismatch() -> Optional[str]:
    """``replacement_mismatch`` of CacheLongWindowLayer (a window as long as the cache), once per process."""
    cache_length = sum(SCRIPTS[0])
    return replacement_mismatch(lambda length: CacheLongWindowLayer(max_cache_len=length), cache_length,
                                cache_length, SCRIPTS[:1])


__all__ = ["CacheLongWindowLayer", "SlidingRingLayer", "cache_long_mismatch", "replacement_mismatch",
           "ring_mismatch"]
