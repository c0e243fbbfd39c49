"""Random numbers as CUDA graphs treat them: graphed, drawn as eager draws them, capture draws nothing.

A CUDA graph registers the default generator at capture and advances its philox offset by the
captured amount on every replay, so a replay draws exactly what the same eager call would draw at
that point of the generator's sequence. graphrt must do the same on both backends: a step with
dropout, ``rrelu``, ``rand_like``, ``multinomial`` or sampling inside it is graphed (not refused by
verification), each replay draws eager's numbers, and capture (warm-up, recording, verification,
wrap()'s warm-up and recording calls) leaves every generator as one eager call per user call would.

Ports, written against graphrt's API:

- PyTorch ``test/test_cuda.py::test_graph_rng_functional``: graphed -> eager -> graphed under
  ``manual_seed(5)`` equals six eager ops; reseeding and replaying repeats eager.
- PyTorch ``test/test_cuda.py::test_graph_rng_distributions``: after a reseed and one eager draw,
  a replay fills what the next two eager draws would.
- PyTorch ``test/inductor/test_cudagraph_trees.py::test_rng_trees``: three calls, reseed, the same
  three results again.

Comparisons are bitwise: a replay runs the same kernels as eager on the same inputs and draws.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS, ToyPagedModel, decode_batch, pad_batch
from faithful_helpers import assert_identical, extend_batch, pad_tokens, rng_state, same_rng_state, set_rng_state
from piecewise_helpers import double_rows

import graphrt
from graphrt import GraphRunner, wrap
from graphrt.check import Severity

ROWS, COLS = 4, 16

# Steps that draw random numbers from the default generator, on a [rows, cols] input in (0, 1).
RANDOM_STEPS = {
    "dropout": lambda x: F.dropout(x, p=0.1, training=True),
    "rrelu": lambda x: F.rrelu(x - 0.5, training=True),
    "rand_like": lambda x: x + torch.rand_like(x),
    "multinomial": lambda x: torch.multinomial(x.softmax(-1), 2, replacement=True),
    "gumbel_sampling": lambda x: (x.log() - torch.empty_like(x).exponential_().log()).argmax(-1),
}
# PyTorch's distribution ops (functions and in-place tensor methods), one draw each.
DISTRIBUTIONS = {
    "bernoulli": torch.bernoulli,
    "normal": lambda x: torch.normal(x + 1, 1.0),
    "poisson": torch.poisson,
    "randn_like": torch.randn_like,
    "randint": lambda x: torch.randint(0, 3, x.shape, device=x.device),
    "bernoulli_": lambda x: torch.empty_like(x).bernoulli_(x),
    "cauchy_": lambda x: torch.empty_like(x).cauchy_(),
    "exponential_": lambda x: torch.empty_like(x).exponential_(),
    "geometric_": lambda x: torch.empty_like(x).geometric_(0.3),
    "log_normal_": lambda x: torch.empty_like(x).log_normal_(),
    "normal_": lambda x: torch.empty_like(x).normal_(),
    "random_": lambda x: torch.empty_like(x).random_(0, 10),
    "uniform_": lambda x: torch.empty_like(x).uniform_(),
}


def uniform_input(device: str) -> torch.Tensor:
    return (torch.rand(ROWS, COLS, generator=torch.Generator().manual_seed(3)) * 0.9 + 0.05).to(device)


def graphed(step, backend: str, device: str):
    """``wrap(step)`` past its warm-up and recording calls, so that the next call replays."""
    fast = wrap(step, max_batch_size=ROWS, capture_sizes=[ROWS], backend=backend)
    x = uniform_input(device)
    with torch.no_grad():
        fast(x)
        fast(x)
    stats = fast.stats()
    assert stats["failed_keys"] == {}, f"a random step must verify: {stats['failed_keys']}"
    assert stats["graph_runs"] == 1 and stats["eager_reasons"] == {"warmup": 1}, stats["eager_reasons"]
    return fast


# ---------------------------------------------------------------- PyTorch test_graph_rng_functional


@pytest.mark.parametrize("op", ["dropout", "rrelu"])
@pytest.mark.parametrize("backend_device", BACKENDS)
def test_graphed_eager_graphed_draws_equal_six_eager_ops(backend_device, op):
    """A graphed call of two ops, two eager ops, a graphed call: the six ops of a control run from
    the same seed. Then, for other seeds, three replays equal three eager calls (and differ from
    the first seed's numbers: replays follow the generator, not a frozen draw)."""
    backend, device = backend_device
    function = {"dropout": lambda x: F.dropout(x, p=0.1, training=True),
                "rrelu": lambda x: F.rrelu(x - 0.5, training=True)}[op]

    def two_ops(x):
        return function(function(x))

    fast = graphed(two_ops, backend, device)
    a = uniform_input(device)
    with torch.no_grad():
        torch.manual_seed(5)
        control = a
        for _ in range(6):
            control = function(control)
        control_state = rng_state(device)

        torch.manual_seed(5)
        out = fast(a).clone()
        out = function(function(out))
        out = fast(out).clone()
        assert_identical(out, control)
        assert same_rng_state(rng_state(device), control_state), "replays advance the generator as eager does"

        for seed in (6, 128, 9999):
            torch.manual_seed(seed)
            replays = [fast(a).clone() for _ in range(3)]
            torch.manual_seed(seed)
            eager = [two_ops(a) for _ in range(3)]
            assert_identical(replays, eager)
            assert not torch.equal(replays[-1], control)
    assert fast.stats()["graph_runs"] == 1 + 2 + 3 * 3


# ---------------------------------------------------------------- PyTorch test_graph_rng_distributions


@pytest.mark.parametrize("op", list(DISTRIBUTIONS))
@pytest.mark.parametrize("backend_device", BACKENDS)
def test_a_replay_draws_what_eager_draws_after_a_reseed_and_an_eager_draw(backend_device, op):
    """Reseed, draw once eagerly, replay a step of two draws: it fills what the next two eager draws
    would (the replay starts where the generator is, including the eager draw's increment)."""
    backend, device = backend_device
    function = DISTRIBUTIONS[op]

    def two_draws(x):
        return function(x), function(x)

    fast = graphed(two_draws, backend, device)
    x = uniform_input(device)
    with torch.no_grad():
        for seed in (6, 314, 271):
            torch.manual_seed(seed)
            function(x)
            first, second = (t.clone() for t in fast(x))
            torch.manual_seed(seed)
            function(x)
            assert_identical((first, second), (function(x), function(x)))


# ---------------------------------------------------------------- PyTorch test_rng_trees


@pytest.mark.parametrize("op", list(RANDOM_STEPS))
@pytest.mark.parametrize("backend_device", BACKENDS)
def test_every_call_from_the_first_draws_what_eager_draws_and_reseeding_repeats_it(backend_device, op):
    """From a fresh wrap(): the warm-up call, the recording call (record, verify, replay) and the
    replays each draw what one eager call draws, so four calls after ``manual_seed(0)`` equal four
    eager calls and leave the generator where they leave it; reseeding repeats the same results."""
    backend, device = backend_device
    step = RANDOM_STEPS[op]
    fast = wrap(step, max_batch_size=ROWS, capture_sizes=[ROWS], backend=backend)
    x = uniform_input(device)
    with torch.no_grad():
        torch.manual_seed(0)
        eager = [step(x) for _ in range(4)]
        eager_state = rng_state(device)
        torch.manual_seed(0)
        first = [fast(x).clone() for _ in range(4)]
        assert same_rng_state(rng_state(device), eager_state), "capture drew numbers no eager call draws"
        torch.manual_seed(0)
        again = [fast(x).clone() for _ in range(4)]
    assert_identical(first, eager)
    assert_identical(again, eager)
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": 1} and stats["graph_runs"] == 7, stats


# ---------------------------------------------------------------- capture draws nothing


class TwoDropouts(torch.nn.Module):
    """Two dropout calls in training mode: a capture that runs the step consumes two draws per run."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(COLS, COLS)

    def forward(self, x):
        return F.dropout(self.linear(F.dropout(x, p=0.5, training=True)), p=0.5, training=True)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_up_front_capture_leaves_every_generator_as_it_was_and_verifies(backend_device):
    """``fast.capture(example)`` runs warm-up, recording and verification: none of them may move
    the generator (CPU and CUDA), and the random step verifies instead of failing."""
    backend, device = backend_device
    torch.manual_seed(1)
    fast = wrap(TwoDropouts().to(device), max_batch_size=ROWS, capture_sizes=[2, ROWS], backend=backend)
    before = rng_state(device)
    report = fast.capture(uniform_input(device))
    assert same_rng_state(rng_state(device), before), "capture consumed random numbers"
    assert report.ok and not report.failed, report.failed


class SamplingToyModel(ToyPagedModel):
    """The toy paged model with sampling inside the step, as engines that graph their sampler do:
    dropout on the logits, a multinomial draw, and Gumbel-max sampling."""

    def forward(self, input_ids, positions, forward_batch):
        logits = F.dropout(super().forward(input_ids, positions, forward_batch), p=0.1, training=True)
        sampled = torch.multinomial(logits.softmax(-1), 1).squeeze(-1)
        gumbel = (logits - torch.empty_like(logits).exponential_().log()).argmax(-1)
        return logits, sampled, gumbel


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_runner_capture_and_retune_leave_every_generator_as_it_was(backend_device):
    """``GraphRunner.capture()`` (two warm-ups, a recording, a verification per key) and
    ``retune()`` draw nothing, and every key of the sampling model verifies."""
    backend, device = backend_device
    runner = GraphRunner(SamplingToyModel(device=device), max_batch_size=8, backend=backend, device=device,
                         progress=False)
    before = rng_state(device)
    report = runner.capture()
    assert same_rng_state(rng_state(device), before), "capture() consumed random numbers"
    assert report.ok and not report.failed, report.failed
    for size in (3, 3, 5):
        runner(decode_batch(size, device=device, seed=size))
    before = rng_state(device)
    report = runner.retune(2)
    assert same_rng_state(rng_state(device), before), "retune() consumed random numbers"
    assert report.ok and not report.failed, report.failed


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_runner_steps_with_sampling_draw_what_eager_draws_at_the_padded_size(backend_device):
    """Each replayed step of the sampling model equals an eager run of the same batch padded to the
    key's size, from the same generator state (bitwise), and leaves the generator where that
    eager run leaves it; the KV writes match too."""
    backend, device = backend_device
    model = SamplingToyModel(device=device)
    control = copy.deepcopy(model)
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=[1, 2, 4, 8], backend=backend, device=device,
                         progress=False)
    report = runner.capture()
    assert not report.failed, report.failed
    torch.manual_seed(7)
    sizes = (3, 5, 8, 1, 6, 3)
    with torch.no_grad():
        for step, size in enumerate(sizes):
            batch = decode_batch(size, device=device, seed=step)
            before = rng_state(device)
            replayed = [t.clone() for t in runner(batch)]
            after = rng_state(device)
            set_rng_state(before)
            padded = pad_batch(batch, 1 << (size - 1).bit_length())
            eager = [t[:size] for t in control(padded.input_ids, padded.positions, padded)]
            assert_identical(replayed, eager)
            assert same_rng_state(after, rng_state(device)), f"step {step}: the replay drew another amount"
    stats = runner.stats()
    assert stats["graph_runs"] == len(sizes) and stats["eager_runs"] == 0, stats["eager_reasons"]
    assert torch.equal(model.kv, control.kv)


# ---------------------------------------------------------------- piecewise


class NoisySplitModel(torch.nn.Module):
    """Dropout in the first piece, a fresh-returning splitting op, ``rand_like`` in the second piece."""

    def __init__(self, device: str) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(1000, 8, generator=generator).to(device))

    def forward(self, input_ids, positions, forward_batch):
        hidden = F.dropout(self.embed[input_ids] + positions[:, None], p=0.2, training=True)
        hidden = double_rows(hidden)
        return hidden + torch.rand_like(hidden)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_piecewise_steps_with_random_ops_in_their_pieces_draw_what_eager_draws(backend_device):
    """Random ops inside graph pieces: the piecewise keys capture without moving the generator,
    verify, and each piecewise step equals eager on the batch padded to its key (bitwise)."""
    backend, device = backend_device
    model = NoisySplitModel(device)
    runner = GraphRunner(model, max_batch_size=4, backend=backend, device=device, progress=False,
                         splitting_ops=[double_rows], piecewise_sizes=[8, 16])
    before = rng_state(device)
    report = runner.capture()
    assert same_rng_state(rng_state(device), before), "piecewise capture consumed random numbers"
    assert report.ok and not report.failed, report.failed
    torch.manual_seed(11)
    with torch.no_grad():
        for seed, counts in enumerate(([3, 2], [5, 4, 2], [7])):
            batch = extend_batch(counts, device=device, seed=seed)
            tokens = batch.num_tokens
            before = rng_state(device)
            replayed = runner(batch).clone()
            after = rng_state(device)
            set_rng_state(before)
            padded = pad_tokens(batch, 8 if tokens <= 8 else 16)
            assert_identical(replayed, model(padded.input_ids, padded.positions, padded)[:tokens])
            assert same_rng_state(after, rng_state(device))
    assert runner.stats()["piecewise_runs"] == 3 and runner.stats()["eager_runs"] == 0


# ---------------------------------------------------------------- explicit generators


class OwnGenerator(torch.nn.Module):
    """Draws from a generator of its own (not the default one)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.generator = torch.Generator(device=device).manual_seed(42)

    def forward(self, x):
        return x + torch.rand(x.shape, generator=self.generator, device=x.device)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_a_step_drawing_from_its_own_generator_replays_its_draws_or_is_refused_by_name(backend_device):
    """Capture leaves a model's own generator as it was too. On the emulated backend the step is
    graphed and draws from that generator as eager does. On CUDA the generator is registered with
    the graph (the same outcome) or the key is refused with a reason that names the generator."""
    backend, device = backend_device
    model, control = OwnGenerator(device), OwnGenerator(device)
    fast = wrap(model, max_batch_size=ROWS, capture_sizes=[ROWS], backend=backend)
    x = uniform_input(device)
    with torch.no_grad():
        before = model.generator.get_state()
        fast.capture(x)
        assert torch.equal(model.generator.get_state(), before), "capture drew from the model's generator"
        results = [fast(x).clone() for _ in range(3)]
    stats = fast.stats()
    assert_identical(results, [control(x) for _ in range(3)])
    if backend == "cuda" and stats["graph_runs"] == 0:
        assert all("generator" in reason for reason in stats["failed_keys"].values()), stats["failed_keys"]
    else:
        assert stats["graph_runs"] == 3 and stats["failed_keys"] == {}, stats


# ---------------------------------------------------------------- graphrt.check


def test_check_tells_that_a_step_draws_random_numbers_as_information():
    """The check still reports the random op, as information that does not make the step unsafe,
    and no longer says that replays draw other numbers than eager."""
    report = graphrt.check(TwoDropouts(), uniform_input("cpu"))
    random_ops = report.of_kind("random_op")
    assert random_ops, [finding.kind for finding in report.findings]
    assert report.ok, str(report)
    for finding in random_ops:
        assert finding.severity is Severity.INFO
        assert "not the ones an eager run would draw" not in finding.message, finding.message
    assert "not the numbers an eager run would draw" not in random_ops[0].to_dict()["fix"]



# ---------------------------------------------------------------- padding rows draw too (issue 42, item 6)


@pytest.mark.parametrize("op", ["dropout", "multinomial"])
def test_wrap_of_a_padded_random_step_draws_eagers_sequence_on_every_call(op):
    """A step that draws for every row, called with 3 rows and capture sizes [4, 8]: padded to 4 rows,
    each replay would move the generator as for 4 rows, so from the second call on every draw would
    depart from eager's (before: the first padded call equal, the later ones not). The padding check
    sees the generator end elsewhere than the real rows' step leaves it: the layout records its calls
    at their exact sizes (said in ``exact_sizes``), and every call draws what eager draws."""
    step = RANDOM_STEPS[op]
    fast = wrap(step, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    x = uniform_input("cpu")[:3]
    with torch.no_grad():
        torch.manual_seed(5)
        eager = [step(x) for _ in range(5)]
        eager_state = rng_state("cpu")
        torch.manual_seed(5)
        got = [fast(x).clone() for _ in range(5)]
    assert_identical(got, eager)
    assert same_rng_state(rng_state("cpu"), eager_state)
    stats = fast.stats()
    assert stats["graph_runs"] == 4, stats["eager_reasons"]
    (why,) = stats["exact_sizes"].values()
    assert "the step draws random numbers for the padding rows too: the default CPU generator ends elsewhere" in why


class DropoutToyModel(ToyPagedModel):
    def forward(self, input_ids, positions, forward_batch):
        return F.dropout(super().forward(input_ids, positions, forward_batch), p=0.5, training=True)


def test_runner_padded_key_matches_eagers_real_size_sequence_on_its_first_call_only():
    """GraphRunner's contract (docs/MANUAL.md, "Random numbers"): a padded key draws for its padding rows
    too. Its first call gives the real rows what eager at the real size draws; the generator then stands
    where the padded eager step leaves it, not the real-size one, so later draws depart from eager's
    real-size sequence (capture the sizes you run, or draw outside the graph, to keep it)."""
    model = DropoutToyModel()
    control = copy.deepcopy(model)
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[2, 4], backend="emulated", progress=False)
    assert not runner.capture().failed
    batch = decode_batch(3, seed=1)
    with torch.no_grad():
        torch.manual_seed(9)
        replayed = runner(batch).clone()
        after_replay = rng_state("cpu")
        torch.manual_seed(9)
        real = control(batch.input_ids, batch.positions, batch)
        after_real = rng_state("cpu")
        torch.manual_seed(9)
        padded = pad_batch(batch, 4)
        padded_out = control(padded.input_ids, padded.positions, padded)
        after_padded = rng_state("cpu")
    assert_identical(replayed, padded_out[:3])  # bitwise at the padded size
    # At the real size: the same draws (the same rows dropped), values within GEMM rounding, which may
    # differ per batch size (1.4e-6 in some rows on a 2-core CPU).
    assert torch.equal(replayed == 0, real == 0)
    torch.testing.assert_close(replayed, real, rtol=1e-5, atol=1e-5)
    assert runner.stats()["graph_runs"] == 1
    assert same_rng_state(after_replay, after_padded) and not same_rng_state(after_replay, after_real)
