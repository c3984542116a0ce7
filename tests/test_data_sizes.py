"""Steady state for blocks whose sizes follow their data (``tape/data_sizes.py``): a loop over the
experts a batch routes to, each expert's weights a slice of one 3-D parameter, as in
transformers' MoE layers. Batches decide which experts run and how many tokens each gets."""

from __future__ import annotations

import copy
import random
import sys
import threading
from collections import Counter

import pytest
import torch
from support import OpCounter, assert_bitwise, reference_and_copy, step, token_ids

import tapesac_core
from tapesac_core.errors import TapeSACError
from tapesac_core.tape.data_sizes import DataBinding
from tapesac_core.tape.steady import Recorded
from tapesac_core.tape.steady_cache import steady_cache
from tapesac_core.tape.tape import ReplayMemo

EXPERTS, D = 4, 8


class Routed(torch.nn.Module):
    """Each token goes to the expert of its largest feature among the first ``EXPERTS``; tokens
    sorted by expert are split by counts read with ``.tolist()``, and the loop runs the experts
    hit, each on its slice of tokens, with its slice of the weights (an index into a 3-D
    parameter: which expert is a packed view's offset, not a number the ops compute with)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(EXPERTS, D, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = x[:, :EXPERTS].argmax(-1)
        order = torch.sort(chosen, stable=True).indices
        counts = torch.bincount(chosen, minlength=EXPERTS).tolist()
        out, start = torch.zeros_like(x), 0
        for e, n in enumerate(counts):
            if n:
                idx = order[start : start + n]
                out = out.index_add(0, idx, torch.tanh(x[idx] @ self.w[e]))
                start += n
        return out + x


def _batch(counts: dict[int, int], seed: int) -> torch.Tensor:
    """Tokens routed ``counts[e]`` to expert ``e``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for e, n in counts.items():
        x = torch.randn(n, D, generator=g)
        x[:, e] += 10.0
        rows.append(x)
    return torch.cat(rows).requires_grad_()


def _run(block: Routed, reference: Routed, x: torch.Tensor) -> tapesac_core.BlockTrace:
    ref = step(reference, lambda: reference(x).pow(2).sum())
    with tapesac_core.trace() as blocks:
        got = step(block, lambda: block(x).pow(2).sum())
    assert_bitwise(ref, got)
    return blocks[0]


def test_token_counts_are_bound_per_call_from_what_autograd_saves() -> None:
    """The same experts and batch size, other token counts per expert every call: three recorded
    calls make a template (two) and confirm it (one), then every call runs in steady state at
    its own sizes, bitwise."""
    torch.manual_seed(0)
    reference = Routed()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    paths = []
    for i in range(8):
        x = _batch({0: 2 + i, 1: 11 - i, 3: 3}, seed=i)
        trace = _run(block, reference, x)
        paths.append("steady" if trace.steady else trace.recorded_because)
    warmup = [str(Recorded.FIRST_CALL)] + [str(Recorded.DATA_SIZES)] * 2
    assert paths == warmup + ["steady"] * 5


def test_another_expert_at_the_same_sizes_is_a_divergence_not_a_wrong_gradient(caplog) -> None:
    """Experts {0, 1}, then {2, 3} with the same counts: the ops and sizes are the same, but the
    packed weight slices lie elsewhere in the parameter. The steady-state call diverges
    (backward recomputes its forward, bitwise), the next calls record and learn the expert
    indices as offsets over an expert's size, and steady state resumes for both sets."""
    torch.manual_seed(0)
    reference = Routed()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    counts = [(3, 5), (4, 4), (6, 2), (2, 6), (5, 3)]
    for i, (a, b) in enumerate(counts):
        trace = _run(block, reference, _batch({0: a, 1: b}, seed=i))
    assert trace.steady
    trace = _run(block, reference, _batch({2: 3, 3: 5}, seed=10))
    assert trace.diverged is not None and "not the sizes, view or dtype" in trace.diverged
    # Recorded calls of both sets, until the indices are told apart, then steady for each.
    later = []
    for i in range(12):
        experts = (0, 1) if i % 2 else (2, 3)
        a, b = counts[i % len(counts)]
        later.append(_run(block, reference, _batch({experts[0]: a, experts[1]: b}, seed=20 + i)))
    assert all(t.diverged is None for t in later)
    assert [t.steady for t in later[-4:]] == [True] * 4


def test_steady_state_calls_bind_their_own_sizes() -> None:
    """What the steady-state calls of the examples' MoE (16 SGD steps over new batches) bound
    differs from call to call, and loss and gradients stay bitwise."""
    reference, model = reference_and_copy(moe=True)
    bound: list[list[int]] = []
    check = DataBinding.check

    def recording(self: DataBinding, k: int, t: torch.Tensor) -> str | None:
        if k == 0:
            bound.append(self.x)
        return check(self, k, t)

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    steady = []
    DataBinding.check = recording  # type: ignore[method-assign]
    try:
        for i in range(12):
            ids = token_ids(i, seq=24)
            ref = step(reference, lambda: reference.loss(ids), seed=i)
            with tapesac_core.trace() as blocks:
                got = step(model, lambda: model.loss(ids), seed=i)
            assert_bitwise(ref, got)
            steady.append(all(b.steady for b in blocks))
            for m in (reference, model):
                m.zero_grad()
            for (_, a), b in zip(reference.named_parameters(), model.parameters()):
                a.grad, b.grad = ref[1].get(_), got[1].get(_)
            for optimizer in optimizers:
                optimizer.step()
    finally:
        DataBinding.check = check  # type: ignore[method-assign]
    assert steady[-6:] == [True] * 6
    assert len({tuple(x) for x in bound}) > 1


def test_a_steady_state_call_with_data_sizes_dispatches_each_op_once() -> None:
    """In steady state the forward runs once, under the checking mode alone: a mode around it
    sees each op once, as it would without checkpointing."""
    torch.manual_seed(0)
    reference = Routed()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    for i in range(5):
        _run(block, reference, _batch({0: 3 + i, 2: 7 - i}, seed=i))
    x = _batch({0: 6, 2: 4}, seed=9)
    with OpCounter() as plain:
        reference(x)
    with OpCounter() as steady, tapesac_core.trace() as blocks:
        block(x)
    assert blocks[0].steady and not blocks[0].diverged
    # Autograd detaches some factory results on its own, depending on who holds them.
    detaches = Counter({"aten.detach.default": 99})
    assert steady.counts - detaches == plain.counts - detaches


class Squared(Routed):
    """``Routed`` with a buffer of its first expert's count squared: a size no affine function
    of the counts gives, though two calls and a third at a count seen fit and confirm one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(torch.bincount(x[:, :EXPERTS].argmax(-1), minlength=EXPERTS)[0].item())
        return super().forward(x) + torch.zeros(n * n, D)[: x.shape[0]].sum()


def test_a_template_that_mispredicts_is_dropped() -> None:
    """Counts 2, 3, 2 make a template (affine in the count) and trust it; at count 5 its steady
    call diverges (the op's size argument, 25, is not the 14 it gives) and the recorded call
    after it drops the template: no call diverges again, every one bitwise."""
    torch.manual_seed(0)
    reference = Squared()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    paths = []
    for i, n in enumerate([2, 3, 2, 5, 5, 2, 3, 2, 6, 2, 7]):
        trace = _run(block, reference, _batch({0: n, 1: 12 - n}, seed=i))
        paths.append("diverged" if trace.diverged else "steady" if trace.steady else "recorded")
    assert paths[:4] == ["recorded"] * 3 + ["diverged"]
    assert "diverged" not in paths[4:], paths


def test_a_replay_memo_shared_by_threads_drops_each_oldest_entry_once() -> None:
    """A template's memo serves every call of its module, in any thread (DataParallel's
    replicas share the module's cache): four threads filling a small memo never lose a race
    over its oldest entry."""
    memo = ReplayMemo(size=2)
    errors: list[str] = []

    def fill(base: int) -> None:
        try:
            for i in range(20000):
                memo.closure(base + i, frozenset(), lambda: [i])
        except Exception as e:  # noqa: BLE001 - a lost race is any error
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch every few bytecodes
    try:
        threads = [threading.Thread(target=fill, args=(k * 10**6,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


def _spread(experts: tuple[int, ...], rng: random.Random, tokens: int = 16) -> dict[int, int]:
    """``tokens`` tokens over ``experts``, each at least one, at random counts."""
    cuts = sorted(rng.sample(range(1, tokens), len(experts) - 1))
    return dict(zip(experts, (b - a for a, b in zip([0, *cuts], [*cuts, tokens]))))


def _path(trace: tapesac_core.BlockTrace) -> str:
    return "diverged" if trace.diverged else "steady" if trace.steady else "recorded"


EVERY, ONE_IDLE = (0, 1, 2, 3), (0, 1, 3)


class LoopedOverHits(Routed):
    """``Routed`` as transformers' eager experts loop: over the rows of ``nonzero`` of the
    experts hit (one ``unbind`` with an output per expert hit: every value after it has another
    id in a call that hits another number of experts), each expert's index a 0-d tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = x[:, :EXPERTS].argmax(-1)
        hit = torch.bincount(chosen, minlength=EXPERTS).nonzero()
        out = torch.zeros_like(x)
        for row in hit:
            e = row[0]
            idx = torch.where(chosen == e)[0]
            out = out.index_add(0, idx, torch.tanh(x[idx] @ self.w[e]))
        return out + x


def _learned(
    sets: list[tuple[int, ...]], rng: random.Random, kind: type[Routed] = Routed
) -> tuple[Routed, Routed]:
    """A reference and a checkpointed copy that has run a call of each expert set of ``sets``,
    bitwise."""
    torch.manual_seed(0)
    reference = kind()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    for i, experts in enumerate(sets):
        _run(block, reference, _batch(_spread(experts, rng), i))
    return reference, block


def _two_sets_learned(rng: random.Random, kind: type[Routed] = Routed) -> tuple[Routed, Routed]:
    """``_learned`` with calls of both expert sets recorded until each set's template is
    trusted."""
    return _learned([EVERY] * 3 + [ONE_IDLE] * 4 + [EVERY, ONE_IDLE, EVERY], rng, kind)


@pytest.mark.parametrize("kind", [Routed, LoopedOverHits])
def test_calls_switch_between_the_templates_of_the_expert_sets_they_hit(kind: type) -> None:
    """Batches that hit experts {0, 1, 2, 3} and {0, 1, 3} in turn, at the same batch size: once
    each set's template is trusted, a call that starts from one set's template and hits the
    other set goes on against the other's (``structure_switch.py``), in steady state and
    bitwise, where it diverged and recomputed before."""
    rng = random.Random(0)
    reference, block = _two_sets_learned(rng, kind)
    paths = [
        _path(_run(block, reference, _batch(_spread((EVERY, ONE_IDLE)[i % 2], rng), 20 + i)))
        for i in range(8)
    ]
    assert paths == ["steady"] * 8, paths


def test_a_call_no_template_of_its_family_fits_diverges_and_is_bitwise() -> None:
    """With the templates of {0, 1, 2, 3} and {0, 1, 3} trusted, a call that hits {0, 2} finds
    no template it can switch to (it departs from both): it diverges, and its backward runs its
    forward again, bitwise; calls of the known sets run in steady state again after it."""
    rng = random.Random(0)
    reference, block = _two_sets_learned(rng)
    assert _path(_run(block, reference, _batch(_spread(ONE_IDLE, rng), 30))) == "steady"
    trace = _run(block, reference, _batch(_spread((0, 2), rng), 31))
    assert trace.diverged is not None
    later = [
        _path(_run(block, reference, _batch(_spread((EVERY, ONE_IDLE)[i % 2], rng), 40 + i)))
        for i in range(8)
    ]
    assert "diverged" not in later and later[-4:] == ["steady"] * 4, later


def test_a_set_of_experts_seen_only_in_diverged_calls_gets_its_template() -> None:
    """Once {0, 1, 2, 3}'s template is active, calls of {0, 1, 3} (one call in three) diverge
    from it, and no call after them records: each diverged call's backward runs its forward
    again recorded (``running._learned_again``), so that {0, 1, 3}'s template is fitted from
    those runs, and later calls of that set switch to it, in steady state. Every call bitwise."""
    rng = random.Random(0)
    reference, block = _learned([EVERY] * 4, rng)
    paths = [
        _path(_run(block, reference, _batch(_spread((EVERY, EVERY, ONE_IDLE)[i % 3], rng), 10 + i)))
        for i in range(18)
    ]
    assert "recorded" not in paths, paths
    assert paths[-6:] == ["steady"] * 6, paths


class OtherInBackward(Routed):
    """``Routed`` that runs one more op when its forward runs inside a backward (as a layer
    that reads a key-value cache its own forward appended to runs other ops when run again)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_backward = torch._C._current_graph_task_id() != -1
        return super().forward(x.neg().neg() if in_backward else x)


def test_a_recomputation_that_runs_other_ops_than_its_forward_is_not_learned() -> None:
    """Calls of {0, 1, 3} diverge from {0, 1, 2, 3}'s template; their backward runs the forward
    again, recorded, but it ran other ops than the forward (``structure_switch.ran_alike``):
    no template learns from it, and that backward is refused (``rerun_checks.py``); every other
    call stays bitwise."""
    rng = random.Random(0)
    reference, block = _learned([EVERY] * 4, rng, OtherInBackward)
    refused = 0
    for i in range(9):
        x = _batch(_spread((EVERY, EVERY, ONE_IDLE)[i % 3], rng), 10 + i)
        try:
            _run(block, reference, x)
        except TapeSACError as e:
            assert "op 0 is aten.neg.default, the forward has aten.slice.Tensor" in str(e)
            refused += 1
    assert refused == 3
    (family,) = steady_cache(block)._data.values()
    learned = [p for s in family.structures for p in s.points]
    assert learned and not any("neg" in n.name for p in learned for n in p.tape.nodes)
