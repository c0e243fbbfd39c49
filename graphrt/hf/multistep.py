"""MultiStepGenerate: greedy generation of a Hugging Face decoder, several decode steps per launch.

``graph_generate`` replays each forward call of ``generate()``; the host still runs between the
steps (logits processing, stopping criteria, the next call). Here one wrapped call runs
``steps_per_launch`` decode steps on a ``StaticCache``: each step's argmax, on the device, is the
next step's input, and position ids advance on the device. ``wrap()`` captures the whole launch as
one graph (the cache an argument: its tensors are read and written in place), so a launch is one
replay. The tokens are ``generate(do_sample=False)``'s: after a row's EOS its tokens are the pad
token, and generation stops once every row has finished, or at ``max_new_tokens``; tokens a launch
chose past the stop are dropped (the cache positions they wrote are reset by the next call).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, Optional

import torch

from graphrt.graphed_callable import GraphedCallable, wrap
from graphrt.hf.cache_keyword import CACHE_KEYWORDS, accepted_cache_keyword

logger = logging.getLogger(__name__)


class MultiStepGenerate:
    """``generate(input_ids, max_new_tokens)`` for ``model`` (a causal LM taking ``position_ids``
    and a ``StaticCache``): the prompt prefilled eagerly, then launches of ``steps_per_launch``
    greedy decode steps, each one replay once recorded. One ``StaticCache`` of ``max_cache_len``
    per batch size, reset in place by each call, so later calls replay from their first launch.
    Prompts of one length, unpadded (no ``attention_mask``). With sliding-window layers, each step's
    mask is built on the device from its positions (graphrt.hf.step_masks), so those launches replay
    too. ``options``: ``wrap()``'s."""

    def __init__(self, model: Any, steps_per_launch: int = 4, max_cache_len: int = 256, max_batch_size: int = 8,
                 backend: str = "auto", **options: Any) -> None:
        if type(steps_per_launch) is not int or steps_per_launch < 1:
            raise ValueError(f"steps_per_launch: expected an int >= 1, got {steps_per_launch!r}")
        self.model = model
        self.steps = steps_per_launch
        self.max_cache_len = max_cache_len
        self.caches: Dict[int, Any] = {}  # batch size -> its StaticCache
        self.masks: Dict[int, Any] = {}  # batch size -> its steps' DecodeMasks (None: the model's own), on the device
        keyword = accepted_cache_keyword(model.forward)
        if keyword is None:
            declared = ", ".join(inspect.signature(model.forward).parameters)
            raise ValueError(f"model.forward: takes no cache keyword (expected `{CACHE_KEYWORDS[0]}` or "
                             f"`{CACHE_KEYWORDS[1]}`; it declares {declared}): a StaticCache passed to it would be "
                             f"ignored and the tokens would be wrong")
        self.cache_keyword = keyword
        # Every batch size a key of its own: a StaticCache is sized to its batch, so padding rows cannot share it.
        self.fast: GraphedCallable = wrap(self._launch, max_batch_size, list(range(1, max_batch_size + 1)), backend,
                                          **options)

    def _launch(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """``steps`` greedy decode steps from ``input_ids`` [B, 1] at ``position_ids`` [B, 1]: their tokens [B, steps]."""
        ids, chosen = input_ids, []
        masks = self.masks[input_ids.shape[0]]
        for step in range(self.steps):
            positions = position_ids + step
            mask = {} if masks is None else {"attention_mask": masks(positions)}  # no host read of the ring's offset
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                                **{self.cache_keyword: cache}, **mask).logits[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            chosen.append(ids)
        return torch.cat(chosen, dim=1)

    def _cache(self, batch_size: int) -> Any:
        """The batch size's StaticCache (reset), made on first use."""
        cache = self.caches.get(batch_size)
        if cache is None:
            from transformers import StaticCache

            from graphrt.hf.layer_kinds import make_graph_safe  # sliding windows: their state on the device
            from graphrt.hf.step_masks import DecodeMasks

            cache = self.caches[batch_size] = make_graph_safe(
                StaticCache(config=self.model.config, max_cache_len=self.max_cache_len), self.model.config)
            self.masks[batch_size] = DecodeMasks.for_cache(cache, self.model.config, self.model.dtype)
        else:
            cache.reset()  # zeroes keys, values and lengths in place: the graphs' tensors stay
        return cache

    def __call__(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The prompt and its greedy continuation, ``[batch, prompt + new]`` as ``generate()`` returns it."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected a [batch, prompt] tensor, got {getattr(input_ids, 'shape', input_ids)}")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        batch, prompt = input_ids.shape
        launches = -(-(max_new_tokens - 1) // self.steps)
        if prompt + 1 + launches * self.steps > self.max_cache_len:
            raise ValueError(f"max_new_tokens: {prompt} prompt tokens and {launches} launches of {self.steps} steps "
                             f"need {prompt + 1 + launches * self.steps} cache positions, max_cache_len is "
                             f"{self.max_cache_len}")
        stops = _Stops(self.model.generation_config, batch, max_new_tokens, input_ids.device)
        cache = self._cache(batch)
        with torch.no_grad():
            logits = self.model(input_ids=input_ids, use_cache=True, **{self.cache_keyword: cache}).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            position = prompt
            stops.add(token)
            while not stops.done:
                launch = self.fast(token, torch.full((batch, 1), position, device=input_ids.device), cache)
                token = launch[:, -1:].clone()  # the next launch's input (the launch's output is overwritten by it)
                position += self.steps
                stops.add(launch)
        return torch.cat([input_ids, stops.tokens()], dim=1)

    def stats(self) -> Dict[str, Any]:
        """The wrapped launch's counters (``graph_runs``: launches replayed)."""
        return self.fast.stats()


class _Stops:
    """``generate()``'s greedy stopping: a row finishes at its EOS (kept); its later tokens are the pad
    token; generation ends when every row has finished or at ``max_new_tokens``. Read from the device
    once per launch when an EOS is configured (whether every row has finished), else never before the end."""

    def __init__(self, generation_config: Any, batch: int, max_new_tokens: int, device: torch.device) -> None:
        eos = getattr(generation_config, "eos_token_id", None)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(generation_config, "pad_token_id", None)
        self.pad = pad if pad is not None else (eos[0] if eos else None)  # as generate() sets it
        self.eos: Optional[torch.Tensor] = torch.tensor(eos, device=device) if eos else None
        self.max_new_tokens = max_new_tokens
        self.chunks: List[torch.Tensor] = []
        self.count = 0
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.done = False
        self.length: Optional[int] = None  # tokens kept once every row has finished

    def add(self, tokens: torch.Tensor) -> None:
        """One launch's tokens [batch, steps] (owned copies kept)."""
        tokens = tokens.clone()
        columns = tokens[:, : self.max_new_tokens - self.count]
        if self.eos is not None:
            seen = torch.cumsum(torch.isin(columns, self.eos), dim=1) > 0  # an EOS at or before each column
            finished = seen | self.finished[:, None]  # finished after each column
            if self.pad is not None:  # after its EOS, a row's tokens are the pad token
                columns.masked_fill_(torch.cat([self.finished[:, None], finished[:, :-1]], dim=1), self.pad)
            self.finished = finished[:, -1]
            every = finished.all(dim=0).tolist()  # the one host read of a launch
            if True in every:
                self.length = self.count + every.index(True) + 1
        self.chunks.append(tokens)
        self.count += tokens.shape[1]
        self.done = self.length is not None or self.count >= self.max_new_tokens

    def tokens(self) -> torch.Tensor:
        """The new tokens, [batch, kept]."""
        length = self.max_new_tokens if self.length is None else min(self.length, self.max_new_tokens)
        return torch.cat(self.chunks, dim=1)[:, :length]
