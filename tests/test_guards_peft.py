"""PEFT adapters through every front (issue 38, item 7), with the real ``peft`` package.

PEFT's documented adapter API flips its layers' Python state between calls: ``disable_adapter()``
and ``set_adapter()`` assign attributes, ``merge_adapter()`` adds the delta to the base weight and
appends to a list, ``scale_layer()`` multiplies a dict entry in place. A graph recorded under one
adapter state must never serve another: through ``wrap``, ``GraphRunner`` and ``graph_generate``
every call gives eager's result (graphs per adapter state, or eager with the reason).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ToyPagedModel, captured_runner, decode_batch, eager_step
from torch import nn

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
from hf_helpers import family_inputs, tiny_model  # noqa: E402

import graphrt  # noqa: E402
from graphrt import wrap  # noqa: E402

LORA = dict(r=4, lora_alpha=8, init_lora_weights=False)  # random A and B: an adapter that changes the output


def lora_llama():
    """The tiny random Llama with two LoRA adapters on its attention projections ("default" active)."""
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj", "v_proj"], **LORA))
    model.add_adapter("other", peft.LoraConfig(target_modules=["q_proj", "v_proj"], **LORA))
    return model.eval()


def adapter_states(model):
    """PEFT's adapter API, each state entered then left: (name, enter, leave)."""
    disabled = []

    def disable():
        disabled.append(model.disable_adapter())
        disabled[-1].__enter__()

    return [
        ("disable_adapter", disable, lambda: disabled.pop().__exit__(None, None, None)),
        ("merge_adapter", model.merge_adapter, model.unmerge_adapter),
        ("scale_layer", lambda: scale_layers(model, 3.0), lambda: scale_layers(model, None)),
        # last: PEFT holds ["default"] at first and "default" once set again, another state than the first
        ("set_adapter", lambda: model.set_adapter("other"), lambda: model.set_adapter("default")),
    ]


def scale_layers(model, scale):
    """``LoraLayer.scale_layer(scale)`` (``self.scaling[adapter] *= scale``, in place) on every LoRA
    layer; ``None``: ``unscale_layer()``, back to ``lora_alpha / r``."""
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.scale_layer(scale) if scale is not None else module.unscale_layer()


def test_wrap_of_a_lora_model_gives_eager_logits_in_every_adapter_state():
    model = lora_llama()
    fast = wrap(model, max_batch_size=2, capture_sizes=[2])
    ids = torch.randint(3, 128, (2, 5))

    def check():
        expected = model(input_ids=ids, use_cache=False).logits
        for _ in range(2):
            torch.testing.assert_close(fast(input_ids=ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
        return expected

    with torch.no_grad():
        first = check()
        for name, enter, leave in adapter_states(model):
            enter()
            logits = check()
            # merged, the model computes what it did (the delta is in the base weight now: a graph of the
            # unmerged path would add it twice); the other states change the logits
            assert torch.allclose(logits, first, atol=1e-4) is (name == "merge_adapter"), name
            leave()
            runs = fast.stats()["graph_runs"]
            torch.testing.assert_close(fast(input_ids=ids, use_cache=False).logits, first, rtol=1e-5, atol=1e-5)
            if name != "set_adapter":
                assert fast.stats()["graph_runs"] == runs + 1, f"the first graphs replay again after {name}"
    assert "python_state:" in " | ".join(fast.stats()["guard_failures"])


class LoraPaged(ToyPagedModel):
    """The toy paged model with a linear head a LoRA adapter is injected into."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(97, 97)

    def forward(self, input_ids, positions, forward_batch):
        return self.head(super().forward(input_ids, positions, forward_batch))


def test_a_runner_with_lora_layers_runs_eagerly_with_the_reason_in_another_adapter_state():
    torch.manual_seed(0)
    model = LoraPaged()
    peft.inject_adapter_in_model(peft.LoraConfig(target_modules=["head"], **LORA), model)
    layer = model.head
    runner = captured_runner(model)
    batch = decode_batch(4)

    def expected():
        return eager_step(copy.deepcopy(model), batch)

    with torch.no_grad():
        first = runner(batch).clone()
        for change, undo in [(lambda: layer.enable_adapters(False), lambda: layer.enable_adapters(True)),
                             (lambda: layer.scale_layer(2.0), lambda: layer.unscale_layer(2.0)),
                             (layer.merge, layer.unmerge)]:
            change()
            assert torch.allclose(runner(batch), expected(), rtol=1e-5, atol=1e-5)
            undo()
            torch.testing.assert_close(runner(batch), first)
    reasons = runner.stats()["eager_reasons"]
    assert reasons.get("python_state") == 3 and runner.stats()["graph_runs"] == 4, reasons


def test_graph_generate_of_a_peft_model_replays_and_follows_adapter_switches():
    """PeftModel.generate() calls the base model's generate(), which calls the base model's forward:
    graph_generate wraps that one, and each adapter state gets eager's tokens (merge and scale are
    covered through wrap() and GraphRunner above)."""
    model = lora_llama()
    reference = copy.deepcopy(model)
    inputs = family_inputs("llama", batch=2)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)

    def same_tokens(name, calls=1):
        expected = reference.generate(**inputs, **options, cache_implementation="static")
        for _ in range(calls):
            assert torch.equal(model.generate(**inputs, **options), expected), name

    with torch.no_grad():
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        same_tokens("default adapter", calls=2)  # the second call replays
        replayed = fast.stats()["graph_runs"]
        assert replayed > 0
        for (name, enter, leave), (_, enter_reference, leave_reference) in zip(adapter_states(model),
                                                                              adapter_states(reference)):
            if name not in ("disable_adapter", "set_adapter"):
                continue
            enter()
            enter_reference()
            same_tokens(name)
            leave()
            leave_reference()
        same_tokens("default adapter again")  # its graphs replay again
    assert fast.stats()["graph_runs"] > replayed


def test_graph_generate_refuses_a_prompt_learning_model_naming_what_to_wrap():
    model = peft.get_peft_model(tiny_model("llama"), peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                           num_virtual_tokens=2))
    with pytest.raises(ValueError, match="graphrt.wrap"):
        graphrt.hf.graph_generate(model, max_batch_size=2)
