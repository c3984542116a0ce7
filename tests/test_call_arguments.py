"""A block call's arguments, flattened once for its input tensors and its signature
(``signature.call_arguments``): Python's own containers are read without pytree, in pytree's
order; anything else goes to pytree; where a tensor sits is part of the signature."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from tapesac_core.tape.signature import Signature, block_signature, call_arguments
from tapesac_core.tape.size_templates import split_signature

Pair = namedtuple("Pair", "a b")


def _t() -> torch.Tensor:
    return torch.zeros(2)


CALLS = {
    "positional": lambda a, b: ((a, 3, None), {}),
    "hf_keywords": lambda a, b: (
        (a,),
        {"position_embeddings": (a, b), "attention_mask": None, "use_cache": False, "ids": b},
    ),
    "nested": lambda a, b: (([a, {"x": (b, 1.5)}],), {"k": [None, a]}),
    "namedtuple": lambda a, b: ((Pair(a, b),), {"scale": 2}),
    "ordered_dict": lambda a, b: ((a,), {"extra": OrderedDict(y=b, x=a)}),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_the_leaves_are_pytrees_in_its_order(call) -> None:
    a, b = _t(), _t()
    args, kwargs = call(a, b)
    leaves, _ = tree_flatten((args, kwargs))
    got = call_arguments(args, kwargs)
    assert len(got.leaves) == len(leaves)
    assert all(x is y or x == y for x, y in zip(got.leaves, leaves))
    assert [id(t) for t in got.tensors] == [id(x) for x in leaves if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_the_same_call_with_other_tensors_has_the_same_structure(call) -> None:
    first = call_arguments(*call(_t(), _t()))
    second = call_arguments(*call(_t(), _t()))
    assert first.structure == second.structure
    assert hash(first.structure) == hash(second.structure)


def test_where_a_tensor_sits_changes_the_structure() -> None:
    a, b = _t(), _t()
    variants = [
        ((a,), {"position_embeddings": (a, b), "mask": None}),
        ((a,), {"position_embeddings": [a, b], "mask": None}),  # a list, not a tuple
        ((a,), {"rotary": (a, b), "mask": None}),  # another keyword
        ((a,), {"mask": None, "position_embeddings": (a, b)}),  # another order
        ((a, (a, b)), {"mask": None}),  # positional
        ((a,), {"position_embeddings": (a, b)}),  # one keyword fewer
    ]
    structures = [call_arguments(*v).structure for v in variants]
    assert len(set(structures)) == len(variants)


def test_integer_keys_are_structure_not_sizes() -> None:
    """Size templates take the integers out of a signature's arguments (the lengths); a dict's
    integer keys say where a tensor sits and stay in the structure."""
    a = _t()

    def call(key: int) -> Signature:
        arguments = call_arguments((a,), {"extra": {key: a}})
        return block_signature(_t, arguments, arguments.tensors, [], (), frozenset())

    masked = [split_signature(call(key))[0] for key in (0, 1)]
    assert masked[0] != masked[1]
