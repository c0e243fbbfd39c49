"""Rotary embeddings whose frequencies depend on the forward's length, given per request on the engine path.

transformers' ``dynamic_rope_update`` picks a rotary module's frequencies from the largest position of
the forward (``max(position_ids) + 1``): Phi-3's ``longrope`` takes its long factors once the forward
reaches past ``original_max_position_embeddings``, ``dynamic`` NTK scaling grows its base with the
length past ``max_position_embeddings``. ``generate()`` serving one request runs its prompt in one
forward (the prompt's length decides) and each new token alone (its position + 1 decides). An engine
step packs several requests, and prefills a long prompt in chunks: the model's own module would give
every token of a step the frequencies of the step's largest position. ``RequestRopes`` gives each token
the frequencies ``generate()`` of its request alone gives it, on a freshly loaded model:

* which modules: those called with ``position_ids`` in the probe step (``rotary_calls``) whose row at
  position 1 differs between a forward of that position alone and one of ``max_context`` tokens
  (``LengthRope``);
  every computation runs the module's own forward on a private copy, its state put back after each run;
* decode steps (full graphs): a table of each position's cos and sin as a forward of that position alone
  gives them, gathered by position on the device (built with a forward per range of positions whose
  frequencies agree at its ends: a few for longrope, one per position where dynamic NTK grows);
* prefill and mixed steps: ``REQUEST_ROPE_OP``, a splitting op that plans per request on the host from
  ``current_batch()`` (as the paged attention does): a chunk's rows of a forward whose largest position
  is the request's (its prompt's length, known from the engine's call; a decode token's position + 1).

Such a module's ``forward`` is replaced once, for good, by ``RopeDispatch``, which serves an engine's
steps this way and calls the module's own forward everywhere else.

Phi-3's ``generate()`` does one more thing (Phi-3, PhiMoE, Phi-4-multimodal: their
``prepare_inputs_for_generation``): when a request that started at most
``original_max_position_embeddings`` tokens long reaches one token more, it drops the request's cache and
computes every token again, with the long factors. The engine does not recompute a request's cache:
``RequestRopes.check_requests`` refuses by name a request that would cross such a point (found by asking
the model's own ``prepare_inputs_for_generation`` at the lengths its config names).
"""

from __future__ import annotations

import copy
import itertools
import logging
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from graphrt.forward_context import current_batch
from graphrt.hf.cache_keyword import accepted_cache_keyword
from graphrt.reference.varlen import request_layout

logger = logging.getLogger(__name__)

CallKey = Tuple[Tuple[Any, ...], Tuple[Tuple[str, Any], ...]]  # a call's arguments besides x and position_ids
_PLAIN = (str, int, float, bool, type(None))
SCAN = 32  # decode-table ranges this short whose frequencies change are run position by position
_ROPES: Dict[int, "weakref.ref[LengthRope]"] = {}  # REQUEST_ROPE_OP's handle -> its LengthRope
_HANDLES = itertools.count(1)


def _split(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[torch.Tensor, torch.Tensor, CallKey]]:
    """(x, position_ids, the other arguments) of a rotary call ``forward(x, position_ids, ...)``, or None
    for a call of another form (or other arguments that cannot key a dict)."""
    rest = dict(kwargs)
    positional = list(args)
    x = positional.pop(0) if positional else rest.pop("x", None)
    positions = positional.pop(0) if positional else rest.pop("position_ids", None)
    key = (tuple(positional), tuple(sorted(rest.items())))
    if not isinstance(x, torch.Tensor) or not isinstance(positions, torch.Tensor):
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return x, positions, key


@contextmanager
def rotary_calls(model: torch.nn.Module) -> Iterator[Dict[torch.nn.Module, Dict[CallKey, torch.Tensor]]]:
    """While entered, every call of a rotary module of ``model`` (a module with a ``rope_type``, transformers'
    convention) is noted: per module, its arguments besides ``x`` and ``position_ids``, with an ``x`` like
    the call's (no elements); the modules' forwards are restored on exit."""
    calls: Dict[torch.nn.Module, Dict[CallKey, torch.Tensor]] = {}
    saved: List[Tuple[torch.nn.Module, Any]] = []

    def recorder(module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            split = _split(args, kwargs)
            if split is not None:
                x, _, key = split
                calls.setdefault(module, {}).setdefault(key, x.new_zeros((1,) * x.dim()))
            return forward(*args, **kwargs)
        return record

    for module in model.modules():
        if hasattr(module, "rope_type") and callable(getattr(module, "forward", None)):
            saved.append((module, vars(module).get("forward")))
            module.forward = recorder(module, module.forward)
    try:
        yield calls
    finally:
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward


class LengthRope:
    """One rotary module called with one set of other arguments (a layer type): whether its rows depend on
    the forward's length up to ``max_context``, and if so its decode table and per-request rows."""

    def __init__(self, module: torch.nn.Module, key: CallKey, like: torch.Tensor, max_context: int,
                 name: str) -> None:
        self.name = name
        self.key = key
        self._forward = type(module).forward
        self._copy = copy.deepcopy(module)
        self._like = like
        args, kwargs = key
        # A forward of one token first: transformers' dynamic scaling goes back to its starting frequencies on a
        # forward shorter than max_position_embeddings (the module may have grown them in an earlier generate()).
        start = torch.zeros((1, 1), dtype=torch.int64, device=like.device)
        self._forward(self._copy, like, start, *args, **dict(kwargs))
        self._state = _snapshot(self._copy)
        self.lengths: Callable[[], Mapping[int, int]] = dict  # request row -> its prompt's length, during a call
        self._positions = torch.arange(max_context, device=like.device)
        self._pair = True  # the module returns (cos, sin), else one tensor
        whole = self._run(self._positions)
        self.depends = whole is not None and not self._alone_at_start(whole, 0, max_context)
        self.table: Optional[torch.Tensor] = None
        self.handle = 0
        if self.depends:
            self.table = self._decode_rows(0, max_context, whole)
            self.handle = next(_HANDLES)
            _ROPES[self.handle] = weakref.ref(self, lambda _, handle=self.handle: _ROPES.pop(handle, None))

    def _alone_at_start(self, rows: torch.Tensor, start: int, end: int) -> bool:
        """Whether ``rows`` (a forward of positions ``start`` to ``end - 1``) hold at their first position past 0 what
        a forward of that position alone gives: the same frequencies, for frequencies that change with the length
        in steps (longrope) or grow with it (dynamic NTK), all rows between then are a decode step's."""
        first = min(max(start, 1), end - 1)
        alone = self._run(self._positions[first: first + 1])[:, 0]
        return torch.equal(rows[:, first - start], alone)

    def _decode_rows(self, start: int, end: int, rows: torch.Tensor) -> torch.Tensor:
        """[2, end - start, dim]: each position from ``start`` to ``end - 1`` as a forward of it alone gives it (a
        decode step's): ``rows`` (a forward of them all) where it agrees at its start, else each half on its own,
        down to ``SCAN`` positions run one by one (a few forwards around longrope's one switch, one per position
        past where dynamic NTK starts growing)."""
        if self._alone_at_start(rows, start, end):
            return rows
        if end - start <= SCAN:
            return torch.stack([self._run(self._positions[position: position + 1])[:, 0]
                                for position in range(start, end)], dim=1)
        middle = (start + end) // 2
        return torch.cat((self._decode_rows(start, middle, self._run(self._positions[start: middle])),
                          self._decode_rows(middle, end, self._run(self._positions[middle: end]))), dim=1)

    def __call__(self, positions: torch.Tensor, decode: bool) -> Any:
        """What the module returns ((cos, sin) [1, T, dim] each) for the current step's tokens at ``positions``
        [1, T]: gathered from the decode table in a ``decode`` step, else planned per request by the op."""
        if decode:
            rows = self.table.index_select(1, positions[0])
        else:
            rows = REQUEST_ROPE_OP(positions[0], self.table, self.handle)
        return tuple(part.unsqueeze(0) for part in rows.unbind(0)) if self._pair else rows[0].unsqueeze(0)

    def rows(self, positions: torch.Tensor, first: int, seq_len: int) -> torch.Tensor:
        """[parts, n, ...]: the module's outputs at ``positions`` [n] (from ``first`` on) in a forward whose
        largest position is ``seq_len - 1`` (a token alone at its position: the decode table's row)."""
        if positions.shape[0] == 1 and seq_len == first + 1:
            return self.table.index_select(1, positions)
        widened = torch.cat((positions, positions.new_full((1,), seq_len - 1)))
        return self._run(widened)[:, :positions.shape[0]]

    def _run(self, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """[parts, n, ...]: the module's own forward (on the private copy) at ``positions`` [n], its state put back:
        its (cos, sin) or its one tensor, each [1, n, ...]; None for outputs of another form."""
        args, kwargs = self.key
        try:
            out = self._forward(self._copy, self._like, positions.unsqueeze(0), *args, **dict(kwargs))
        finally:
            _restore(self._copy, self._state)
        self._pair = isinstance(out, tuple)
        parts = out if self._pair else (out,)
        first = parts[0] if parts else None
        if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape[:2] != (1, positions.shape[0]):
            return None
        if not all(isinstance(part, torch.Tensor) and part.shape == first.shape and part.dtype == first.dtype
                   for part in parts):
            return None
        return torch.stack([part[0] for part in parts])


def _snapshot(module: torch.nn.Module) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, torch.Tensor]]:
    """What a rotary module's forward may change: its attributes, its buffers (which ones, and their values)."""
    buffers = dict(module._buffers)
    return dict(vars(module)), buffers, {name: tensor.clone() for name, tensor in buffers.items() if tensor is not None}


def _restore(module: torch.nn.Module, state: Tuple[Dict[str, Any], Dict[str, Any], Dict[str, torch.Tensor]]) -> None:
    attributes, buffers, values = state
    vars(module).clear()
    vars(module).update(attributes)
    module._buffers.clear()
    module._buffers.update(buffers)
    for name, value in values.items():
        buffers[name].copy_(value)


@torch.library.custom_op("graphrt_hf::request_rope", mutates_args=())
def request_rope(positions: torch.Tensor, table: torch.Tensor, handle: int) -> torch.Tensor:
    """[parts, T, ...] (cos and sin) of the current prefill or mixed batch's tokens at ``positions`` [T], each
    request's as a forward of its own length gives them (its prompt's length, from the engine's call; a
    decode token: its position + 1), planned on the host per request. Rows past the batch's tokens are zeros."""
    rope = _ROPES[handle]()
    batch = current_batch()
    if rope is None or batch is None:
        raise RuntimeError("request_rope: no current batch or engine; call it inside a graphrt engine step")
    out = table.new_zeros((table.shape[0], positions.shape[0], *table.shape[2:]))
    rows = batch.req_pool_indices.tolist()
    lengths = rope.lengths()
    for request, (start, q_len, prefix) in enumerate(request_layout(batch)):
        if q_len:
            seq_len = max(prefix + q_len, lengths.get(rows[request], 0))
            out[:, start: start + q_len] = rope.rows(positions[start: start + q_len], prefix, seq_len)
    return out


@request_rope.register_fake
def _(positions: torch.Tensor, table: torch.Tensor, handle: int) -> torch.Tensor:
    return table.new_empty((table.shape[0], positions.shape[0], *table.shape[2:]))


REQUEST_ROPE_OP = torch.ops.graphrt_hf.request_rope


class RopeDispatch:
    """A length-dependent rotary module's ``forward``: in a step of an engine that registered the module (its
    request table's pool in ``ropes``), each request's frequencies (``LengthRope``); elsewhere the module's own."""

    def __init__(self, module: torch.nn.Module, fallback: Optional[Callable[..., Any]]) -> None:
        self._module = module
        self._fallback = fallback  # an instance forward the module had before, if any
        self.ropes: "weakref.WeakKeyDictionary[Any, Dict[CallKey, LengthRope]]" = weakref.WeakKeyDictionary()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = current_batch()
        pool = getattr(batch, "req_to_token_pool", None)
        ropes = self.ropes.get(pool) if pool is not None else None
        if ropes:
            split = _split(args, kwargs)
            if split is not None:
                _, positions, key = split
                rope = ropes.get(key)
                if rope is not None and positions.dim() == 2 and positions.shape[0] == 1:
                    return rope(positions, batch.forward_mode.is_decode_or_idle())
        if self._fallback is not None:
            return self._fallback(*args, **kwargs)
        return type(self._module).forward(self._module, *args, **kwargs)

    def __getstate__(self) -> Dict[str, Any]:  # a copied model's module: its own forward, no engine's
        return {"_module": self._module, "_fallback": self._fallback}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["_module"], state["_fallback"])


def _recompute_length(model: torch.nn.Module, max_context: int) -> int:
    """The number of tokens at which ``model``'s ``generate()`` drops a request's cache and computes it again
    (0: never, as far as the lengths its config names tell, below ``max_context``): its own
    ``prepare_inputs_for_generation`` asked with a cache one token shorter than each of them."""
    from transformers import DynamicCache

    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or {}
    named = {getattr(config, "original_max_position_embeddings", None),
             getattr(config, "max_position_embeddings", None), rope.get("original_max_position_embeddings"),
             *(values.get("original_max_position_embeddings") for values in rope.values() if isinstance(values, dict))}
    keyword = accepted_cache_keyword(model.forward)
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if keyword is None or prepare is None:
        return 0
    for length in sorted(value for value in named if isinstance(value, int) and 0 < value < max_context - 1):
        cache = DynamicCache()
        cache.update(torch.zeros(1, 1, length, 1), torch.zeros(1, 1, length, 1), 0)
        ids = torch.ones((1, length + 1), dtype=torch.int64)
        try:
            prepared = prepare(ids, **{keyword: cache}, attention_mask=torch.ones_like(ids), use_cache=True)
        except Exception as error:  # a model whose preparation needs more than ids and a cache: no answer
            logger.debug("engine: %s.prepare_inputs_for_generation failed on a stand-in cache: %s",
                         type(model).__name__, error)
            continue
        if prepared.get(keyword) is None:
            return length + 1
    return 0


def _same(one: torch.Tensor, other: torch.Tensor) -> bool:
    return one.dtype == other.dtype and one.device == other.device and torch.equal(one, other)


def _values(key: CallKey) -> List[Any]:
    args, kwargs = key
    return [*args, *(value for _, value in kwargs)]


class RequestRopes:
    """The length-dependent rotary embeddings of one engine's model (none for most models), served per request
    in the engine's steps once ``attach``-ed to its pools; ``serving`` tells them each request row's prompt length."""

    def __init__(self, ropes: Dict[torch.nn.Module, Dict[CallKey, LengthRope]], recompute_at: int = 0,
                 name: str = "") -> None:
        self.ropes = ropes
        self.recompute_at = recompute_at  # generate() computes a request's cache again at this many tokens (0: never)
        self._name = name

    @classmethod
    def build(cls, model: torch.nn.Module, calls: Dict[torch.nn.Module, Dict[CallKey, torch.Tensor]],
              max_context: int) -> "RequestRopes":
        """The rotary calls (``rotary_calls``) whose frequencies depend on the forward's length within
        ``max_context`` tokens; ValueError naming a length-dependent module called with arguments graphrt
        cannot key (tensors: another object every call)."""
        names = {module: name for name, module in model.named_modules()}
        ropes: Dict[torch.nn.Module, Dict[CallKey, LengthRope]] = {}
        with torch.no_grad():
            for module, keys in calls.items():
                for key, like in keys.items():
                    name = f"{type(model).__name__}.{names.get(module, type(module).__name__)}"
                    rope = LengthRope(module, key, like, max_context, name)
                    if not rope.depends:
                        continue
                    if not all(isinstance(value, _PLAIN) for value in _values(key)):
                        raise ValueError(f"model: {name}'s frequencies depend on the forward's length and it is "
                                         "called with tensor arguments besides position_ids; graphrt cannot give "
                                         "each request its own frequencies")
                    ropes.setdefault(module, {})[key] = rope
        for module, by_key in ropes.items():
            logger.info("engine: %s (rope_type %s) picks its frequencies by the forward's length: each request gets "
                        "its own (%d call form(s))", names.get(module), getattr(module, "rope_type", "?"), len(by_key))
        return cls(ropes, _recompute_length(model, max_context) if ropes else 0, type(model).__name__)

    def check_requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """ValueError naming the first request that would reach ``recompute_at`` tokens after starting below it
        (``generate()`` computes its cache again there, with other frequencies; the engine does not)."""
        at = self.recompute_at
        for index, prompt in enumerate(prompts):
            if at and len(prompt) < at <= len(prompt) + max_new_tokens - 1:
                raise ValueError(
                    f"prompts[{index}]: {self._name}'s generate() computes a request's cache again, with the rotary "
                    f"frequencies of its new length, when it reaches {at} tokens after a shorter prompt (its "
                    f"prepare_inputs_for_generation); the engine path does not, and this prompt of {len(prompt)} "
                    f"tokens would reach it with max_new_tokens={max_new_tokens}: serve it with at most "
                    f"{at - len(prompt)} new tokens, or a prompt of at least {at} tokens")

    def attach(self, pool: Any) -> None:
        """Serve the steps whose request table is ``pool`` (an engine's) per request, from now on."""
        for module, by_key in self.ropes.items():
            dispatch = vars(module).get("forward")
            if not isinstance(dispatch, RopeDispatch):
                dispatch = RopeDispatch(module, dispatch)
                module.forward = dispatch
            dispatch.ropes[pool] = by_key

    @contextmanager
    def serving(self, lengths: Callable[[], Mapping[int, int]]) -> Iterator[None]:
        """While entered, ``lengths()`` says each request row's prompt length (the length of its prefill forward)."""
        every = [rope for by_key in self.ropes.values() for rope in by_key.values()]
        for rope in every:
            rope.lengths = lengths
        try:
            yield
        finally:
            for rope in every:
                rope.lengths = dict

    def same_as(self, other: "RequestRopes") -> bool:
        """Whether ``other`` serves the same modules and call forms with the same tables (a probe again that read
        the same)."""
        if {module: set(by_key) for module, by_key in self.ropes.items()} != \
                {module: set(by_key) for module, by_key in other.ropes.items()}:
            return False
        return all(_same(rope.table, other.ropes[module][key].table)
                   for module, by_key in self.ropes.items() for key, rope in by_key.items())

    def describe(self) -> str:
        return ", ".join(sorted(rope.name for by_key in self.ropes.values() for rope in by_key.values())) or "none"


__all__ = ["LengthRope", "REQUEST_ROPE_OP", "RequestRopes", "RopeDispatch", "request_rope", "rotary_calls"]
