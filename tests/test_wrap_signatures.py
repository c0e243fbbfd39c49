"""wrap() on real model signatures: batch axes of outputs and arguments are learned from shapes,
arguments are pytrees, autograd callers run eagerly, and what cannot be graphed says why.

Every case compares with the eager call: a wrapped call returns eager's result, or runs eagerly
with a counted reason.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from conftest import ToyPagedModel, decode_batch
from hf_helpers import cache_argument

from graphrt import ForwardMode, GraphRunner, wrap
from graphrt.hf.cache_keyword import accepted_cache_keyword

ATOL, RTOL = 1e-5, 1e-4
LAYERS, HIDDEN = 2, 16


def assert_same(got, expected):
    """Same pytree of tensors: structure, shapes, values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for name in expected:
            assert_same(got[name], expected[name])
    elif isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for item, reference in zip(got, expected):
            assert_same(item, reference)
    else:
        assert got == expected


def recurrent(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    return cls(8, HIDDEN, num_layers=LAYERS, batch_first=True).eval()


def zero_state(kind: str, batch: int):
    h = torch.zeros(LAYERS, batch, HIDDEN)
    return (h, h.clone()) if kind == "lstm" else h


# ---------------------------------------------------------------- outputs: h_n is [layers, batch, hidden]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_state_outputs_are_cut_along_the_batch_dim(kind):
    # bs=1 pads to 2 == num_layers and bs=3 pads to 4: before, h_n came back [1, 2, 16] and [2, 4, 16].
    module = recurrent(kind)
    fast = wrap(module, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in (3, 1, 2, 3, 1, 2, 5, 5):
            x = torch.randn(batch, 5, 8, generator=generator)
            assert_same(fast(x), module(x))
    stats = fast.stats()
    assert stats["graph_runs"] == 5 and stats["eager_reasons"] == {"warmup": 3}, stats


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_streaming_with_the_state_passed_back_in(kind):
    module = recurrent(kind)
    fast = wrap(module, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(2)
    state = expected_state = zero_state(kind, 3)
    with torch.no_grad():
        for _ in range(6):
            chunk = torch.randn(3, 4, 8, generator=generator)
            out, state = fast(chunk, state)
            expected_out, expected_state = module(chunk, expected_state)
            assert_same((out, state), (expected_out, expected_state))
    stats = fast.stats()
    # the first state is contiguous, the ones passed back are cut from a graph's output (the batch dim
    # inside): a layout each, a warm-up each (a layout recorded on contiguous calls never replays a strided one)
    assert stats["graph_runs"] == 4 and stats["eager_reasons"] == {"warmup": 2}, stats
    state_paths = [path for path in stats["arg_layout"] if path.startswith("args[1]")]
    assert state_paths and all(stats["arg_layout"][path] == "dim 1" for path in state_paths)


def run_stream(fast, module, batches, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for batch in batches:
            chunk = torch.randn(batch, 4, 8, generator=generator)
            state = (torch.randn(LAYERS, batch, HIDDEN, generator=generator),
                     torch.randn(LAYERS, batch, HIDDEN, generator=generator))
            assert_same(fast(chunk, state), module(chunk, state))
    return fast.stats()


def test_state_seen_at_batch_equal_to_layers_replays_unpadded_until_another_size_decides():
    # [layers=2, batch=2, hidden]: dims 0 and 1 both hold the batch size. Unpadded calls are exact
    # whichever dim is the batch; bs=3 shows dim 1 and the callable captures again with it.
    module = recurrent("lstm")
    fast = wrap(module, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated")
    stats = run_stream(fast, module, (2, 2, 2, 3, 3, 3, 1, 1), seed=3)
    assert stats["arg_layout"]["args[1][0]"] == "dim 1" and stats["signature_changes"] == 1
    assert stats["eager_reasons"] == {"warmup": 3} and stats["graph_runs"] == 5, stats


def test_state_seen_at_batch_equal_to_layers_is_not_padded_by_a_guess():
    # bs=2 pads to 4: padding dim 0 or dim 1 of the state would be a guess, so those calls run eagerly.
    module = recurrent("lstm")
    fast = wrap(module, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    stats = run_stream(fast, module, (2, 2, 3, 3, 3, 2, 2), seed=4)
    assert stats["eager_reasons"] == {"ambiguous_batch_axis": 2, "warmup": 1} and stats["graph_runs"] == 4, stats
    assert stats["arg_layout"]["args[1][0]"] == "dim 1" and stats["signature_changes"] == 1


def test_a_tensor_seen_as_batched_by_coincidence_becomes_fixed():
    weight = torch.randn(4, 6)
    fn = lambda x, w: x @ w  # noqa: E731 - w is [4, 6]; the first call's batch size is 4 too
    fast = wrap(fn, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(4)
    for batch in (4, 4, 3, 3, 3, 5):
        x = torch.randn(batch, 4, generator=generator)
        assert_same(fast(x, weight), fn(x, weight))
    stats = fast.stats()
    assert stats["arg_layout"] == {"args[0]": "dim 0", "args[1]": "fixed"} and stats["signature_changes"] == 1
    assert stats["graph_runs"] == 3


# ---------------------------------------------------------------- outputs that cannot be cut


def test_output_without_a_batch_axis_runs_padded_calls_eagerly():
    fn = lambda x: (x * 2, x.sum(0), x.shape[0])  # noqa: E731 - a batch sum, and a Python int of the size
    fast = wrap(fn, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(5)
    for batch in (4, 4, 3, 3, 4, 8, 8, 7):
        x = torch.randn(batch, 3, generator=generator)
        assert_same(fast(x), fn(x))
    stats = fast.stats()
    # bs=3 first probes the output axes (outputs were seen at bs=4 only), then knows output[1] cannot be cut
    assert stats["eager_reasons"] == {"warmup": 2, "axis_probe": 1, "unsliceable_output": 2}, stats
    assert stats["graph_runs"] == 3, "unpadded calls replay: the batch sum has no padding rows in it"
    assert "output[1]" in stats["uncut_outputs"]["call/bs=4"]


def test_non_tensor_output_that_follows_the_batch_size_is_not_frozen():
    fn = lambda x: (x + 1, x.shape[0])  # noqa: E731
    fast = wrap(fn, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    for batch in (4, 4, 3, 3):
        x = torch.ones(batch, 2)
        assert fast(x)[1] == batch
    assert fast.stats()["eager_reasons"] == {"warmup": 1, "axis_probe": 1, "unsliceable_output": 1}


# ---------------------------------------------------------------- arguments are pytrees


@dataclasses.dataclass
class State:
    hidden: torch.Tensor  # [batch, 4]
    scale: float


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass
class Result:
    total: torch.Tensor
    parts: Pair
    note: str = "ok"


def nested_fn(x, masks, state, pair, table):
    total = (x * masks["keep"] + state.hidden * state.scale) @ table
    return Result(total, Pair(pair.left * 2, pair.right.T))


def nested_args(batch: int, generator: torch.Generator, scale: float = 0.5):
    x = torch.randn(batch, 4, generator=generator)
    masks = {"keep": (torch.rand(batch, 1, generator=generator) > 0.5).float()}
    state = State(torch.randn(batch, 4, generator=generator), scale)
    pair = Pair(torch.randn(batch, 2, generator=generator), torch.randn(batch, 5, generator=generator))
    return x, masks, state, pair


def test_tensors_nested_in_dicts_dataclasses_and_namedtuples_get_static_slots():
    table = torch.randn(4, 5)
    fast = wrap(nested_fn, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(6)
    for batch in (3, 3, 3, 1, 1, 6, 6):
        args = nested_args(batch, generator)
        got, expected = fast(*args, table), nested_fn(*args, table)
        assert isinstance(got, Result) and got.note == "ok" and isinstance(got.parts, Pair)
        assert_same((got.total, tuple(got.parts)), (expected.total, tuple(expected.parts)))
    stats = fast.stats()
    assert stats["graph_runs"] == 4 and set(stats["eager_reasons"]) == {"warmup"}, stats
    assert stats["arg_layout"] == {
        "args[0]": "dim 0", "args[1]['keep']": "dim 0", "args[2].hidden": "dim 0", "args[2].scale": "constant",
        "args[3].left": "dim 0", "args[3].right": "dim 0", "args[4]": "fixed",
    }
    # a nested constant that differs, or a different nesting, is another layout: a warm-up of its own
    args = nested_args(3, generator, scale=2.0)
    assert_same(fast(*args, table).total, nested_fn(*args, table).total)
    x, masks, state, pair = nested_args(3, generator)
    masks["unused"] = masks["keep"]
    assert_same(fast(x, masks, state, pair, table).total, nested_fn(x, masks, state, pair, table).total)
    stats = fast.stats()
    assert stats["eager_reasons"]["warmup"] == 3 + 2 and len(stats["layouts"]) == 3
    assert stats["arg_layout"]["args[1]['unused']"] == "dim 0"


def test_copy_outputs_and_debug_guards_work_on_dataclass_outputs():
    table = torch.randn(4, 5)
    generator = torch.Generator().manual_seed(7)
    for options in ({"copy_outputs": True}, {"debug": True}):
        fast = wrap(nested_fn, max_batch_size=4, capture_sizes=[4], backend="emulated", **options)
        fast.capture(*nested_args(4, generator), table)
        args = nested_args(4, generator)
        got = fast(*args, table)
        assert_same(got.total, nested_fn(*args, table).total)
        assert fast.stats()["graph_runs"] == 1


def test_capture_of_another_layout_captures_it_beside_the_first():
    table = torch.randn(4, 5)
    fast = wrap(nested_fn, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(8)
    assert fast.capture(*nested_args(3, generator), table).ok
    first = fast.signature
    slots = {name: slot.tensor.clone() for name, slot in first.buffers.slots.items()}
    report = fast.capture(*nested_args(3, generator, scale=2.0), table)  # another constant: another layout
    assert len(report.ok) == 2 and fast.signature is not first
    assert all(torch.equal(slot.tensor, slots[name]) for name, slot in first.buffers.slots.items())
    for scale in (0.5, 2.0, 0.5):
        args = nested_args(5, generator, scale=scale)
        assert_same(fast(*args, table).total, nested_fn(*args, table).total)
    stats = fast.stats()
    assert stats["graph_runs"] == 3 and stats["eager_runs"] == 0, stats
    assert stats["key_hits"] == {"call/bs=8": 2, "layout1:call/bs=8": 1}


def test_capture_refuses_to_pad_along_an_ambiguous_axis():
    module = recurrent("gru")
    fast = wrap(module, max_batch_size=4, capture_sizes=[2, 4], backend="emulated")
    with pytest.raises(ValueError, match=r"args\[1\]: the batch size 2 is the size of several of its dims"):
        fast.capture(torch.randn(2, 3, 8), torch.zeros(LAYERS, 2, HIDDEN))
    assert fast.capture(torch.randn(3, 3, 8), torch.zeros(LAYERS, 3, HIDDEN)).ok


# ---------------------------------------------------------------- autograd callers


def encoder_and_embedding():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    return encoder, torch.nn.Embedding(50, 16)


def test_inputs_that_require_grad_run_eagerly_and_gradients_flow():
    encoder, embedding = encoder_and_embedding()
    fast = wrap(encoder, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(9)
    for batch in (3, 3, 5, 2):  # the second size used to fail staging: "a leaf Variable that requires grad"
        ids = torch.randint(0, 50, (batch, 6), generator=generator)
        embedding.zero_grad()
        fast(embedding(ids)).square().sum().backward()
        got = embedding.weight.grad.clone()
        embedding.zero_grad()
        encoder(embedding(ids)).square().sum().backward()
        torch.testing.assert_close(got, embedding.weight.grad, atol=ATOL, rtol=RTOL)
    assert fast.stats()["eager_reasons"] == {"autograd": 4} and fast.stats()["graph_runs"] == 0
    assert not any(slot.tensor.requires_grad for slot in fast.signature.buffers.slots.values())


def test_grad_mode_with_parameters_that_require_grad_runs_eagerly_until_no_grad():
    """Grad mode on, plain inputs, parameters that require grad: eager outputs carry history, so the
    calls (the warm-up included) run eagerly with autograd; under no_grad the same sizes replay."""
    encoder, _ = encoder_and_embedding()
    fast = wrap(encoder, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(10)
    for batch in (3, 3, 5):
        x = torch.randn(batch, 6, 16, generator=generator)
        out = fast(x)
        assert out.requires_grad and torch.equal(out, encoder(x))
    assert fast.stats()["graph_runs"] == 0 and fast.stats()["eager_reasons"] == {"warmup": 1, "autograd": 2}
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 6, 16, generator=generator)
            assert_same(fast(x), encoder(x))
    assert fast.stats()["graph_runs"] == 3


# ---------------------------------------------------------------- Hugging Face model objects


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.5)
    return transformers.LlamaForCausalLM(config).eval()


def test_hf_model_without_cache_returns_its_model_output():
    model = tiny_llama()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    fast = wrap(model, max_batch_size=4, capture_sizes=[2, 4], backend="emulated")
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for batch in (3, 3, 1, 1, 3):
            ids = torch.randint(0, 64, (batch, 6), generator=generator)
            got = fast(ids, attention_mask=causal, use_cache=False)
            expected = model(ids, attention_mask=causal, use_cache=False)
            assert type(got) is type(expected) and list(got.keys()) == ["logits"]
            assert_same(got.logits, expected.logits)
    assert fast.stats()["graph_runs"] == 3, fast.stats()


def test_hf_model_with_use_cache_is_refused_naming_the_cache_output():
    model = tiny_llama()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4], backend="emulated")
    generator = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 64, (4, 6), generator=generator)
            assert_same(fast(ids, use_cache=True).logits, model(ids, use_cache=True).logits)
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": 1, "capture_failed": 2}
    reason = stats["failed_keys"]["call/bs=4"]
    keyword = accepted_cache_keyword(model.forward)  # the output field transformers returns the cache in
    assert f"output.{keyword} is a transformers.cache_utils.DynamicCache, not a tensor pytree" in reason


def test_a_dynamic_cache_argument_is_refused_and_left_as_eager_leaves_it():
    transformers = pytest.importorskip("transformers")
    model = tiny_llama()

    def step(ids, cache):
        return model(input_ids=ids, **cache_argument(model, cache), use_cache=True).logits[:, -1]

    generator = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, 64, (2, 5), generator=generator)
    caches, tokens = [], []
    for wrapped in (True, False):
        cache = transformers.DynamicCache(config=model.config)
        fast = wrap(step, max_batch_size=2, capture_sizes=[2], backend="emulated") if wrapped else step
        with torch.no_grad():
            token = model(input_ids=prompt, **cache_argument(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(4):
                token = fast(token, cache).argmax(-1, keepdim=True)
                tokens.append(token)
        caches.append(cache.get_seq_length())
        if wrapped:
            reason = fast.stats()["failed_keys"]["call/bs=2"]
            assert reason.startswith("RebindError: args[1].layers[0].keys: the step rebinds it")
    assert caches == [9, 9], "the refused recording's appends to the cache were undone"
    assert all(torch.equal(a, b) for a, b in zip(tokens[:4], tokens[4:]))


def test_hf_model_with_a_static_cache_argument_replays_and_returns_that_cache():
    transformers = pytest.importorskip("transformers")
    model = tiny_llama()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(14))
    tokens = []
    for wrapped in (True, False):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        fast = wrap(model, max_batch_size=2, capture_sizes=[2], backend="emulated") if wrapped else model
        with torch.no_grad():
            token = model(input_ids=prompt, **cache_argument(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
            for position in range(5, 10):
                out = fast(input_ids=token, **cache_argument(model, cache), position_ids=torch.full((2, 1), position),
                           use_cache=True)
                keyword = accepted_cache_keyword(model.forward)
                assert getattr(out, keyword) is cache, "an object passed in comes back as itself"
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(token)
        if wrapped:
            assert fast.stats()["graph_runs"] == 4 and fast.stats()["eager_reasons"] == {"warmup": 1}
    assert all(torch.equal(a, b) for a, b in zip(tokens[:5], tokens[5:]))


class CountingState:
    def __init__(self):
        self.calls = 0
        self.total = torch.zeros(())


def test_an_object_argument_rebinding_a_python_counter_is_refused_once_per_call():
    def step(x, state):
        state.calls += 1
        state.total.add_(1)
        return x * 2

    state = CountingState()
    fast = wrap(step, max_batch_size=2, capture_sizes=[2], backend="emulated")
    for _ in range(3):
        fast(torch.ones(2, 3), state)
    assert state.calls == 3 and int(state.total) == 3
    assert fast.stats()["failed_keys"]["call/bs=2"].startswith("RebindError: args[1].calls")


# ---------------------------------------------------------------- GraphRunner: tokens vs requests


def test_runner_cuts_outputs_along_learned_axes_and_refuses_fixed_ones():
    model = ToyPagedModel()

    def forward(input_ids, positions, forward_batch):
        logits = model(input_ids, positions, forward_batch)
        return {"transposed": logits.T, "total": logits.sum(0)}

    runner = GraphRunner(forward, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated", progress=False)
    runner.capture()
    for batch_size in (4, 3):
        out = runner(decode_batch(batch_size, seed=batch_size))
        assert out["transposed"].shape == (97, batch_size)
    stats = runner.stats()
    assert stats["graph_runs"] == 1 and stats["eager_reasons"] == {"unsliceable_output": 1}
    assert stats["uncut_outputs"]["decode/bs=4"].startswith("output['total']: has shape [97]")


class ExtendOnly:
    graph_modes = frozenset({ForwardMode.EXTEND})


def test_runner_tells_the_token_axis_from_the_request_axis():
    def forward(input_ids, positions, forward_batch):
        return input_ids.float()[:, None] * 2, forward_batch.seq_lens.float()[None, :] + 1

    runner = GraphRunner(forward, max_batch_size=4, modes=(ForwardMode.EXTEND,), backend="emulated", progress=False,
                         extend_capture_sizes=([4, 8], [2, 4]), batch_context={"attn_backend": ExtendOnly()})
    runner.capture()
    batch = decode_batch(3, seed=1, forward_mode=ForwardMode.EXTEND, extend_num_tokens=5,
                         input_ids=torch.arange(1, 6), positions=torch.arange(5), out_cache_loc=torch.arange(10, 15),
                         seq_lens=torch.tensor([2, 2, 1], dtype=torch.int32), seq_lens_sum=5,
                         extend_seq_lens=torch.tensor([2, 2, 1], dtype=torch.int32),
                         extend_prefix_lens=torch.zeros(3, dtype=torch.int32),
                         extend_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32))
    per_token, per_request = runner(batch)
    assert runner.stats()["graph_runs"] == 1
    assert_same((per_token, per_request), forward(batch.input_ids, batch.positions, batch))
