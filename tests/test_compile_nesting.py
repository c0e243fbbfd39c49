"""torch.compile and graphrt nested either way (issue 42, items 1 to 3).

graphrt inside compiled code: graphrt's entry points are opaque to Dynamo, so ``torch.compile`` around a
wrapped function, a compiled step that calls one, a compiled function that calls a GraphRunner, and
``model.forward`` compiled after ``graph_generate`` break their graph at graphrt's call and replay
graphrt's graphs (before: Dynamo traced graphrt's Python and hit ``set_stance``; every call ran eagerly
or raised). Compiled code inside graphrt: ``graph_generate(torch.compile(model))`` reaches the original
module's forward, compiled as the model was (before: generate() ran the original forward, none of its
calls seen, nothing counted), and a compile with CUDA graphs of its own anywhere in ``generate()``'s
forward is refused by name. Compile backends here are Dynamo's cheap ones (``CompileCounter``,
``eager``, ``cudagraphs`` on CPU tensors): they trace as inductor does, without its C++ build.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ToyPagedModel, decode_batch
from torch._dynamo.testing import CompileCounter

import graphrt
from graphrt.backends.compiled import OPAQUE_REASON

ROWS, COLS = 3, 8


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(COLS, 2 * COLS)
        self.down = torch.nn.Linear(2 * COLS, COLS)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def inputs(calls: int = 5):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, COLS, generator=generator) for _ in range(calls)]


def test_torch_compile_around_a_wrapped_module_replays_its_graphs():
    model = MLP().eval()
    fast = graphrt.wrap(model, max_batch_size=8)
    compiled = torch.compile(fast, backend="eager")
    with torch.no_grad():
        for x in inputs():
            torch.testing.assert_close(compiled(x), model(x))
    stats = fast.stats()
    assert stats["graph_runs"] == 4 and stats["eager_reasons"] == {"warmup": 1} and stats["failed_keys"] == {}, stats


def test_a_compiled_step_calling_a_wrapped_function_compiles_around_it_and_replays_it():
    """The ops before and after graphrt's call are compiled (two frames: the graph break between them);
    graphrt's call replays and nothing graphrt runs is compiled by the enclosing torch.compile."""
    model = MLP().eval()
    fast = graphrt.wrap(model, max_batch_size=8)
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step(x):
        return fast(x * 2) - 1

    with torch.no_grad():
        for x in inputs():
            torch.testing.assert_close(step(x), model(x * 2) - 1)
    assert fast.stats()["graph_runs"] == 4
    assert counter.frame_count == 2 and counter.op_count == 2, "x * 2 and the subtraction, nothing of graphrt's"


def test_a_compiled_function_calling_a_graph_runner_replays():
    model = ToyPagedModel()
    runner = graphrt.GraphRunner(model, max_batch_size=8, capture_sizes=[4, 8], backend="emulated", progress=False)
    assert not runner.capture().failed
    control = copy.deepcopy(model)
    step = torch.compile(lambda batch: runner(batch) * 1.0, backend="eager")
    with torch.no_grad():
        for seed in range(3):
            batch = decode_batch(3, seed=seed)
            torch.testing.assert_close(step(batch), control(batch.input_ids, batch.positions, batch))
    assert runner.stats()["graph_runs"] == 3


def test_fullgraph_around_graphrt_says_why_it_cannot_be_one_graph():
    fast = graphrt.wrap(MLP().eval(), max_batch_size=8)
    compiled = torch.compile(lambda x: fast(x) + 1, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="graphrt replays its own CUDA graphs: its call runs outside torch.compile"):
        with torch.no_grad():
            compiled(inputs(1)[0])
    assert "graph break" in OPAQUE_REASON


def test_every_front_states_what_it_wraps():
    model = MLP().eval()
    assert graphrt.wrap(model, max_batch_size=4).stats()["wraps"] == "MLP"
    assert graphrt.wrap(model.forward, max_batch_size=4).stats()["wraps"] == "MLP.forward"
    compiled = torch.compile(model, backend="eager")
    assert graphrt.wrap(compiled, max_batch_size=4).stats()["wraps"] == "torch.compile(MLP, backend='eager')"
    runner = graphrt.GraphRunner(torch.compile(ToyPagedModel().forward, backend="aot_eager"), max_batch_size=4,
                                 backend="emulated", progress=False)
    assert runner.stats()["wraps"] == "torch.compile(ToyPagedModel.forward, backend='aot_eager')"


class Holder:
    """A plain class whose objects a guard reads through (a cache layer, an engine object)."""


def test_compiled_code_setting_an_attribute_of_a_watched_class_compiles():
    """graphrt patches ``__setattr__`` of the plain classes its guards read through (issue 38). Dynamo
    traced the patch's ``object.__setattr__`` held in a closure as ``Tensor.__setattr__`` and called the
    patch again without end: once any StaticCache was guarded, a compiled Hugging Face forward failed
    with ``RecursionError`` when its cache layer set an attribute (before: InternalTorchDynamoError)."""
    from graphrt.guards import epoch

    epoch.install()
    assert epoch.watch_class(Holder)
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step(holder, x):
        holder.value = x * 2
        return holder.value + 1

    holder = Holder()
    assert torch.equal(step(holder, torch.ones(2)), torch.full((2,), 3.0))
    assert torch.equal(holder.value, torch.full((2,), 2.0)) and counter.frame_count == 1


# ---------------------------------------------------------------- Hugging Face generate()

pytest.importorskip("transformers")
from hf_helpers import VOCAB, tiny_model  # noqa: E402

from graphrt.hf import graph_generate  # noqa: E402

NEW_TOKENS = 4


def prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))


def eager_tokens(model):
    return model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")


def test_graph_generate_of_a_compiled_model_replays_its_original_forward_compiled_alike():
    """Before: generate() ran the original module's forward; graphrt saw none of its calls."""
    model = tiny_model("gpt2")
    expected = eager_tokens(model)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    fast = graph_generate(compiled, max_batch_size=4)
    assert torch.equal(compiled.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    stats = fast.stats()
    assert stats["graph_runs"] == NEW_TOKENS - 2 and stats["failed_keys"] == {}, stats
    assert stats["wraps"] == "torch.compile(GPT2LMHeadModel.forward, backend='CompileCounter')"
    assert counter.frame_count >= 1, "the wrapped forward is compiled as the model was"


def test_model_forward_compiled_after_graph_generate_replays():
    model = tiny_model("gpt2")
    expected = eager_tokens(model)
    fast = graph_generate(model, max_batch_size=4)
    model.forward = torch.compile(model.forward, backend="eager")
    for _ in range(2):
        assert torch.equal(model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    stats = fast.stats()
    assert stats["graph_runs"] >= 2 * (NEW_TOKENS - 1) - 1 and stats["failed_keys"] == {}, stats


def test_graph_generate_refuses_a_cuda_graph_compile_of_the_decoder_by_name():
    """``model.transformer = torch.compile(model.transformer, mode="reduce-overhead")``, the recipe for a
    decoder's body (the ``cudagraphs`` backend here: CUDA graphs of its own, traced without inductor's
    build): every forward call runs eagerly with eager's tokens, the key refused naming it and the fix;
    handed whole to graph_generate, it is refused at once."""
    model = tiny_model("gpt2")
    expected = eager_tokens(model)
    model.transformer = torch.compile(model.transformer, backend="cudagraphs")
    fast = graph_generate(model, max_batch_size=4)
    assert torch.equal(model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    stats = fast.stats()
    assert stats["graph_runs"] == 0 and stats["failed_keys"], stats
    assert all(reason.startswith("NestedGraphsError: the step runs torch.compile(GPT2Model, backend='cudagraphs') "
                                 "captures CUDA graphs of its own") for reason in stats["failed_keys"].values())
    with pytest.raises(ValueError, match=r"model: torch.compile\(GPT2LMHeadModel.*max-autotune-no-cudagraphs"):
        graph_generate(torch.compile(tiny_model("gpt2"), mode="reduce-overhead"), max_batch_size=4)
