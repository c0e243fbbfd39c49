"""Real engines' client code with its one compile/capture line replaced by graphrt (tests/client_helpers.py).

gpt-fast's decode loop (greedy, sampled, speculative with a draft model passed to the same
wrapped function) and a nano-vllm-style paged engine (block tables, a slot_mapping store that
skips -1, a global forward context read by the attention, capture under inference mode), the
latter through ``wrap()`` and through ``GraphRunner``. Each gives eager's tokens, and most of its
decode calls replay. The transformers docs' static-cache recipes are in tests/test_hf_recipes.py.
"""

from __future__ import annotations

import functools

import torch
from client_helpers import GptFast, ModelRunner, Qwen3ForCausalLM, Transformer, decode_one_token, model_forward

import graphrt

PROMPT = torch.tensor([3, 17, 5, 40, 9], dtype=torch.int)


def replayed_share(stats) -> float:
    return stats["graph_runs"] / (stats["graph_runs"] + stats["eager_runs"])


def test_gpt_fast_decode_loop_greedy_and_sampled_with_decode_one_token_wrapped():
    model = Transformer()
    fast = graphrt.wrap(decode_one_token, max_batch_size=4)
    for greedy in (True, False):
        torch.manual_seed(11)
        expected = GptFast().generate(model, PROMPT, max_new_tokens=7, batch_size=2, greedy=greedy)
        torch.manual_seed(11)
        got = GptFast(decode_one_token=fast).generate(model, PROMPT, max_new_tokens=7, batch_size=2, greedy=greedy)
        assert torch.equal(got, expected), (greedy, got, expected)
    assert len(set(expected[0].tolist())) > 3, "the sampled tokens should vary"
    stats = fast.stats()
    assert stats["failed_keys"] == {} and replayed_share(stats) >= 0.8, stats["eager_reasons"]


def test_gpt_fast_speculative_decoding_with_model_forward_and_decode_one_token_wrapped():
    """The draft and the target model both go through one wrapped model_forward (a model argument)."""
    target, draft = Transformer(seed=0), Transformer(seed=1)
    torch.manual_seed(5)
    expected = GptFast().speculative_generate(target, draft, PROMPT, max_new_tokens=10, speculate_k=3)
    clients = GptFast(graphrt.wrap(decode_one_token, max_batch_size=2), graphrt.wrap(model_forward, max_batch_size=2))
    torch.manual_seed(5)
    got = clients.speculative_generate(target, draft, PROMPT, max_new_tokens=10, speculate_k=3)
    assert torch.equal(got, expected)
    decode_stats, forward_stats = clients.decode_one_token.stats(), clients.model_forward.stats()
    assert decode_stats["failed_keys"] == {} and replayed_share(decode_stats) >= 0.8
    assert forward_stats["failed_keys"] == {} and forward_stats["graph_runs"] >= 2
    assert forward_stats["eager_reasons"].get("warmup", 0) <= len(forward_stats["layouts"]), "one warm-up per layout"


PROMPTS = [[5, 9, 2, 33, 7], [12, 3, 8], [40, 41, 42, 43, 44, 45, 1], [2, 2, 9, 17], [30, 6]]
MAX_TOKENS = [9, 4, 12, 6, 10]  # sequences finish at different steps: batches of 5, 4, 3, 2 and 1


def nano_vllm(mode: str):
    runner = ModelRunner(Qwen3ForCausalLM(block_size=4), mode)
    return runner, runner.generate(PROMPTS, MAX_TOKENS)


@functools.lru_cache(maxsize=1)
def eager_tokens():
    return nano_vllm("eager")[1]


def test_nano_vllm_engine_eager_reference_is_deterministic():
    first, second = eager_tokens(), nano_vllm("eager")[1]
    assert first == second and all(len(first[i]) == MAX_TOKENS[i] for i in range(len(PROMPTS)))
    assert len({token for tokens in first.values() for token in tokens}) > 5


def test_nano_vllm_engine_through_wrap_with_the_context_passed_as_arguments():
    """Padded decode batches (3 and 5 sequences pad to 4 and 8) with slot -1 for the padding rows:
    sequence 0's tokens went wrong at 3 and 5 sequences when padding rows wrote slot 0."""
    expected = eager_tokens()
    runner, got = nano_vllm("wrap")
    assert got == expected
    stats = runner.graphed.stats()
    assert stats["failed_keys"] == {} and stats["exact_sizes"] == {} and stats["padded_tokens"] > 0
    assert replayed_share(stats) >= 0.5, stats["eager_reasons"]


def test_nano_vllm_engine_through_graph_runner_captured_under_inference_mode():
    expected = eager_tokens()
    runner, got = nano_vllm("runner")
    assert got == expected
    stats = runner.graphed.stats()
    assert stats["eager_runs"] == 0 and stats["graph_runs"] == max(MAX_TOKENS) - 1 and stats["padded_tokens"] > 0


def test_nano_vllm_model_wrapped_directly_reads_the_global_context_and_is_refused():
    """``self.model = graphrt.wrap(self.model)`` in nano-vllm's run_model: the attention reads its slots
    from get_context(), a new tensor every step. Capture is refused (op and line named), every step
    runs eagerly with eager's tokens, and model.compute_logits still works through the wrapper."""
    expected = eager_tokens()
    runner = ModelRunner(Qwen3ForCausalLM(block_size=4), "eager")
    runner.model = graphrt.wrap(runner.model, max_batch_size=8)
    assert runner.generate(PROMPTS, MAX_TOKENS) == expected
    stats = runner.model.stats()
    assert stats["graph_runs"] == 0
    assert any(reason.startswith("OutsideTensorError: graphrt_test.store_kvcache") and "client_helpers.py" in reason
               for reason in stats["failed_keys"].values()), stats["failed_keys"]
