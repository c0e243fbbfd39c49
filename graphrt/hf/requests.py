"""One served request: its parameters, its state while the scheduler serves it, why it finished, its times.

``RequestParams`` is what a caller of the online engine (graphrt.hf.online) gives per request, as vLLM's
``SamplingParams`` and SGLang's sampling params are: new-token limit and minimum, stop ids, seed,
``ignore_eos``, log-probabilities. ``Request`` is the scheduler's (graphrt.hf.serve) state of one
request; ``FinishReason`` says why it ended (vLLM's stop / length / abort, with the EOS ids told apart
from the request's own stop ids, and ``rejected`` for a request refused alone); ``RequestTimes`` its
queue time, time to first token and time per output token (host clock, taken at admission, at its
first token and at its end: never per step).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from graphrt.hf.request_sampling import RequestTokens
from graphrt.host.sampling import SamplingMetadata

MAX_TOP_LOGPROBS = 20  # the most top-k log-probabilities a request may ask for (vLLM's default max_logprobs)


class FinishReason(str, enum.Enum):
    """Why a request ended."""

    STOP = "stop"  # one of its own stop ids was chosen
    EOS = "eos"  # one of the model's EOS ids was chosen
    LENGTH = "length"  # max_new_tokens, or the engine's max_context
    ABORT = "abort"  # abort(id)
    REJECTED = "rejected"  # refused alone when added (``error`` says why)


@dataclass
class RequestParams:
    """One request's parameters. ``max_new_tokens``: the most new tokens; ``stop_token_ids``: ids that end it
    beside the EOS ids (the token is kept, as with EOS); ``min_new_tokens``: new tokens before any stop or EOS
    id may be chosen (None: the generation config's); ``seed``: its sampling generator's seed (None: its
    request id); ``ignore_eos``: the EOS ids do not end it; ``logprobs``: the chosen tokens' log-probabilities
    (under the model's logits, before any processor); ``top_logprobs``: also the k most likely tokens' (at most
    ``MAX_TOP_LOGPROBS``); ``sampling``: one row of sampling parameters (None: the generation config's
    sampling, or greedy)."""

    max_new_tokens: int = 16
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: Optional[int] = None
    seed: Optional[int] = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    sampling: Optional[SamplingMetadata] = None

    def check(self, vocab_size: int) -> None:
        """ValueError/TypeError naming the first field that is not valid."""
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (list, tuple)) or not all(type(token) is int and 0 <= token < vocab_size
                                                           for token in stops):
            raise ValueError(f"stop_token_ids: expected a list of token ids (ints from 0 to {vocab_size - 1}), "
                             f"got {stops!r}")
        if self.min_new_tokens is not None and (type(self.min_new_tokens) is not int or self.min_new_tokens < 0):
            raise ValueError(f"min_new_tokens: expected None or an int >= 0, got {self.min_new_tokens!r}")
        if self.seed is not None and type(self.seed) is not int:
            raise TypeError(f"seed: expected None or an int, got {self.seed!r}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if type(self.top_logprobs) is not int or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs: expected an int from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.sampling is not None and (not isinstance(self.sampling, SamplingMetadata)
                                          or self.sampling.num_reqs != 1):
            raise ValueError(f"sampling: expected a SamplingMetadata of one row, got {self.sampling!r}")


@dataclass
class RequestTimes:
    """Host clock (``time.perf_counter``) when the request was added, admitted (took its row), chose its first
    token and ended."""

    added: float = field(default_factory=time.perf_counter)
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None

    def summary(self, tokens: int) -> Dict[str, Optional[float]]:
        """``queue_s`` (added to admitted), ``ttft_s`` (added to first token), ``tpot_s`` (per output token after
        the first, up to its end); None where not reached yet."""
        queue = None if self.admitted is None else self.admitted - self.added
        ttft = None if self.first_token is None else self.first_token - self.added
        tpot = None
        if self.finished is not None and self.first_token is not None and tokens > 1:
            tpot = (self.finished - self.first_token) / (tokens - 1)
        return {"queue_s": queue, "ttft_s": ttft, "tpot_s": tpot}


@dataclass
class Request:
    """One prompt being served: its request row, how many KV slots it was assigned and how many of its
    tokens are in the KV cache, what its tokens are chosen from, the ids that stop it (``tokens.stops``; of
    those, ``eos`` the model's), its token limit, and how many tokens were chosen for it (read into its output,
    or one still on the device: row ``carried`` of the last step launched); once ended, why."""

    index: int
    arrival: int
    tokens: RequestTokens
    max_new_tokens: int = 0  # 0: the call's (ServeConfig.max_new_tokens)
    eos: FrozenSet[int] = frozenset()
    row: int = 0
    assigned: int = 0  # KV slots held in its table row (released with it, whatever happens to the step)
    cached: int = 0
    chosen: int = 0
    carried: int = -1
    stopped: bool = False  # one of its stop ids was read: later tokens are dropped
    finish_reason: Optional[FinishReason] = None
    times: RequestTimes = field(default_factory=RequestTimes)
    logprobs: Optional[List[Tuple[float, List[Tuple[int, float]]]]] = None  # per token: chosen, top k

    def __post_init__(self) -> None:
        self.prompt: List[int] = self.tokens.prompt  # the same lists: a token appended to one is in both
        self.output: List[int] = self.tokens.output
        self.stops: FrozenSet[int] = self.tokens.stops

    @property
    def prefilling(self) -> bool:
        """True while part of the prompt is not in the KV cache yet."""
        return self.cached < len(self.prompt)

    @property
    def in_flight(self) -> bool:
        """True while its last chosen token is on the device, not read yet."""
        return self.chosen > len(self.output)


@dataclass
class RequestOutput:
    """What the online engine reports of a request: its tokens so far (from ``step()``: the request's own list,
    which later steps grow, and ``new``, those of this step, with the log-probabilities of those only; from
    ``output()``: copies of all, ``new`` empty), whether it ended and why (``error``: why it was rejected), its
    log-probabilities when asked for (per token: the chosen token's, and ``top_logprobs`` pairs (token,
    log-probability), most likely first) and its times."""

    request_id: int
    tokens: List[int]
    new: List[int]
    finished: bool
    finish_reason: Optional[FinishReason]
    error: Optional[str] = None
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    times: Dict[str, Any] = field(default_factory=dict)


__all__ = ["FinishReason", "MAX_TOP_LOGPROBS", "Request", "RequestOutput", "RequestParams", "RequestTimes"]
