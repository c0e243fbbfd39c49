"""Several decode steps per launch: multi-step keys and ``GraphRunner.decode``.

``keys`` (multi-step keys: one more kind of key in the runner's registry, K decode steps in one
graph, their stager and static slots), ``steps`` (the batch of each step of a launch, the default
``next_tokens``), ``decode`` (serving a ``decode()`` call: one multi-step replay, else its steps one
by one, counted with the reason).
"""

from graphrt.multistep.decode import MultiStepDecoder, MultiStepReason, check_call, unavailable_reason
from graphrt.multistep.keys import add_multistep_keys, register_step_slots, step_slot
from graphrt.multistep.steps import NextTokens, batch_at_step, chosen_tokens, greedy, run_steps

__all__ = [
    "MultiStepDecoder",
    "MultiStepReason",
    "NextTokens",
    "add_multistep_keys",
    "batch_at_step",
    "check_call",
    "chosen_tokens",
    "greedy",
    "register_step_slots",
    "run_steps",
    "step_slot",
    "unavailable_reason",
]
