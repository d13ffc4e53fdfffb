"""Tests for pippy_split.microbatch: split -> merge round trips and error messages."""

from __future__ import annotations

import collections
import dataclasses
import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from pippy_split import microbatch
from pippy_split.microbatch import (
    MicrobatchError,
    Replicate,
    TensorChunkSpec,
    merge_chunks,
    split_args_kwargs,
)

Pair = collections.namedtuple("Pair", ["left", "right"])


class Box:
    """A container registered with pytree without key names (positional fallback)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


pytree.register_pytree_node(Box, lambda box: ([box.a, box.b], None), lambda ch, _: Box(*ch))


def assert_tree_equal(a, b) -> None:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def round_trip(args, kwargs, n, args_spec=None, kwargs_spec=None, merge_spec=None, **kw):
    mbs = split_args_kwargs(args, kwargs, n, args_spec, kwargs_spec, **kw)
    assert len(mbs) == n
    merged_args = merge_chunks([a for a, _ in mbs], merge_spec if merge_spec is not None else args_spec)
    merged_kwargs = merge_chunks([k for _, k in mbs], kwargs_spec)
    return mbs, merged_args, merged_kwargs


# --------------------------------------------------------------------------- #
# Round trips (property-based)
# --------------------------------------------------------------------------- #


@st.composite
def chunked_tensors(draw, allow_uneven: bool):
    """1-3 tensors sharing a batch size along their own chunk dims, plus n."""
    n = draw(st.integers(1, 5))
    batch = n * draw(st.integers(1, 3)) + (draw(st.integers(0, n - 1)) if allow_uneven else 0)
    tensors, specs = [], []
    for _ in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 4))
        dim = draw(st.integers(-ndim, ndim - 1))
        shape = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
        shape[dim] = batch
        dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bool]))
        tensors.append((torch.rand(shape) * 10).to(dtype))
        specs.append(TensorChunkSpec(dim))
    return tensors, specs, n, batch


@settings(max_examples=60, deadline=None)
@given(chunked_tensors(allow_uneven=False))
def test_round_trip_random_shapes_and_dims(case) -> None:
    tensors, specs, n, batch = case
    half = len(tensors) // 2  # some positional, the rest keyword
    args, kwargs = tuple(tensors[:half]), {f"k{i}": t for i, t in enumerate(tensors[half:])}
    args_spec = tuple(specs[:half])
    kwargs_spec = {f"k{i}": s for i, s in enumerate(specs[half:])}
    mbs, merged_args, merged_kwargs = round_trip(args, kwargs, n, args_spec, kwargs_spec)
    for mb_args, mb_kwargs in mbs:
        for t, s in zip((*mb_args, *mb_kwargs.values()), specs):
            assert t.shape[s.dim] == batch // n
    assert_tree_equal(merged_args, args)
    assert_tree_equal(merged_kwargs, kwargs)


@settings(max_examples=60, deadline=None)
@given(chunked_tensors(allow_uneven=True))
def test_round_trip_uneven(case) -> None:
    tensors, specs, n, batch = case
    mbs, merged, _ = round_trip(tuple(tensors), {}, n, tuple(specs), allow_uneven=True)
    sizes = [mb_args[0].shape[specs[0].dim] for mb_args, _ in mbs]
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # larger chunks first, like tensor_split
    assert_tree_equal(merged, tuple(tensors))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 4), k=st.integers(1, 3), extra=st.integers(0, 2))
def test_round_trip_nested_containers_default_spec(n: int, k: int, extra: int) -> None:
    b = n * k
    args = (
        torch.randn(b, 3),
        [torch.randn(b), {"a": torch.randn(b, 2, 2), "flag": "relu", "none": None}],
        Pair(torch.arange(b), 7),
        Box(torch.randn(b, 1), 2.5),
        torch.tensor(3.0),  # 0-dim: replicated, not chunked
        torch.Size([b, 3]),
    )
    kwargs = {
        "mask": torch.ones(b, 4 + extra, dtype=torch.bool),
        "scale": 0.5,
        "cache": (None, torch.randn(b)),
    }
    mbs, merged_args, merged_kwargs = round_trip(args, kwargs, n)
    mb_args, mb_kwargs = mbs[-1]
    assert isinstance(mb_args[1], list) and isinstance(mb_args[2], Pair) and isinstance(mb_args[3], Box)
    assert mb_args[1][1]["a"].shape == (k, 2, 2)
    assert mb_args[1][1]["flag"] == "relu" and mb_args[3].b == 2.5 and mb_kwargs["scale"] == 0.5
    assert mb_args[4] is args[4] and type(mb_args[5]) is torch.Size
    assert_tree_equal(merged_args, args)
    assert_tree_equal(merged_kwargs, kwargs)


def test_nested_spec_per_leaf() -> None:
    x = torch.randn(4, 6)
    pair = (torch.randn(6, 2), torch.randn(4))
    spec = (TensorChunkSpec(1), (TensorChunkSpec(0), Replicate))
    mbs, merged, _ = round_trip((x, pair), {}, 2, spec)
    assert mbs[0][0][0].shape == (4, 3)
    assert mbs[0][0][1][0].shape == (3, 2)
    assert mbs[1][0][1][1] is pair[1]
    assert_tree_equal(merged, (x, pair))


def test_leaf_spec_applies_to_a_whole_subtree() -> None:
    batch = {"q": torch.randn(2, 8), "k": torch.randn(3, 8), "meta": "abc"}
    mbs = split_args_kwargs((), {"batch": batch}, 4, kwargs_chunk_spec={"batch": TensorChunkSpec(-1)})
    assert [mb[1]["batch"]["q"].shape for mb in mbs] == [(2, 2)] * 4
    assert mbs[0][1]["batch"]["meta"] == "abc"
    merged = merge_chunks([kw for _, kw in mbs], {"batch": TensorChunkSpec(-1)})
    assert_tree_equal(merged, {"batch": batch})


def test_none_argument_with_container_spec() -> None:
    mbs = split_args_kwargs((), {"cache": None}, 2, kwargs_chunk_spec={"cache": (TensorChunkSpec(1), None)})
    assert [kw["cache"] for _, kw in mbs] == [None, None]


def test_one_leaf_spec_for_all_args() -> None:
    mbs = split_args_kwargs((torch.randn(3, 4), torch.randn(5, 4)), {}, 2, TensorChunkSpec(1))
    assert mbs[1][0][0].shape == (3, 2) and mbs[1][0][1].shape == (5, 2)


def test_replicate_gives_every_microbatch_the_same_object() -> None:
    table = torch.randn(5, 5)
    mbs, merged, merged_kwargs = round_trip((torch.randn(4, 5), table), {"t": table}, 4,
                                            (None, Replicate), {"t": Replicate})
    assert all(a[1] is table and k["t"] is table for a, k in mbs)
    assert merged[1] is table and merged_kwargs["t"] is table
    assert repr(Replicate) == "Replicate"


def test_custom_split_and_merge() -> None:
    tokens = list(range(6))

    def split_list(value, n):
        return [value[i::n] for i in range(n)]

    def merge_lists(values):
        out = [None] * sum(len(v) for v in values)
        for i, v in enumerate(values):
            out[i :: len(values)] = v
        return out

    mbs = split_args_kwargs((tokens, torch.randn(2, 3)), {}, 2, (split_list, None))
    assert mbs[0][0][0] == [0, 2, 4] and mbs[1][0][0] == [1, 3, 5]
    merged = merge_chunks([a for a, _ in mbs], (merge_lists, None))
    assert merged[0] == tokens


def test_chunks_are_views() -> None:
    x = torch.randn(4, 2)
    (a, _), _ = split_args_kwargs((x,), {}, 2)
    a[0].fill_(0.0)
    assert torch.all(x[:2] == 0)


def test_empty_and_all_replicated() -> None:
    assert split_args_kwargs((), {}, 3) == [((), {})] * 3
    assert split_args_kwargs(("a", 1), None, 2) == [(("a", 1), {})] * 2


def test_names_render_parameter_names() -> None:
    with pytest.raises(MicrobatchError, match=r"argument 'input_ids' has batch size 10"):
        split_args_kwargs((torch.zeros(10, 3),), {}, 4, names=["input_ids"])
    with pytest.raises(MicrobatchError, match=r"'input_ids\['a'\]'|input_ids\['a'\]"):
        split_args_kwargs(({"a": torch.zeros(3)},), {}, 4, names=["input_ids"])


# --------------------------------------------------------------------------- #
# Split errors: every one names the argument
# --------------------------------------------------------------------------- #


def test_not_divisible() -> None:
    with pytest.raises(MicrobatchError) as info:
        split_args_kwargs((torch.zeros(10, 3),), {}, 4)
    assert str(info.value).startswith(
        "argument 'args[0]' has batch size 10 along dim 0, not divisible into 4 microbatches"
    )
    assert isinstance(info.value, ValueError)


def test_not_divisible_kwarg_and_nested() -> None:
    with pytest.raises(MicrobatchError, match=r"argument kwargs\['mask'\] has batch size 6"):
        split_args_kwargs((), {"mask": torch.zeros(6)}, 4)
    with pytest.raises(MicrobatchError, match=r"argument 'args\[1\]\[0\]' has batch size 3"):
        split_args_kwargs(("x", [torch.zeros(3, 2)]), {}, 2)
    with pytest.raises(MicrobatchError, match=r"'args\[0\]\.left'"):
        split_args_kwargs((Pair(torch.zeros(3), 1),), {}, 2)
    with pytest.raises(MicrobatchError, match=r"'args\[0\]\[0\]'"):  # no key names: positions
        split_args_kwargs((Box(torch.zeros(3), 1),), {}, 2)


@pytest.mark.parametrize("allow_uneven", [False, True])
def test_batch_smaller_than_n(allow_uneven: bool) -> None:
    msg = r"argument 'args\[0\]' has batch size 2 along dim 1, smaller than 4 microbatches"
    with pytest.raises(MicrobatchError, match=msg):
        split_args_kwargs((torch.zeros(5, 2),), {}, 4, (TensorChunkSpec(1),), allow_uneven=allow_uneven)


def test_batch_sizes_disagree() -> None:
    with pytest.raises(MicrobatchError) as info:
        split_args_kwargs((torch.zeros(8, 3),), {"mask": torch.zeros(2, 6)}, 2,
                          kwargs_chunk_spec={"mask": TensorChunkSpec(1)})
    msg = str(info.value)
    assert "kwargs['mask'] has batch size 6 along dim 1" in msg
    assert "'args[0]' has batch size 8 along dim 0" in msg


def test_bad_chunk_dim() -> None:
    with pytest.raises(MicrobatchError, match=r"'args\[0\]' has shape \(4, 3\), cannot chunk along dim 2"):
        split_args_kwargs((torch.zeros(4, 3),), {}, 2, (TensorChunkSpec(2),))
    with pytest.raises(MicrobatchError, match=r"'args\[0\]' has shape \(\), cannot chunk along dim 0"):
        split_args_kwargs((torch.tensor(1.0),), {}, 2, (TensorChunkSpec(0),))


def test_spec_structure_mismatch() -> None:
    with pytest.raises(MicrobatchError, match=r"args_chunk_spec has 1 entries but 2 positional"):
        split_args_kwargs((torch.zeros(2), torch.zeros(2)), {}, 2, (None,))
    with pytest.raises(MicrobatchError, match=r"chunk spec for argument 'args\[0\]' has 3 entries"):
        split_args_kwargs(([torch.zeros(2), 1],), {}, 2, ((None, None, None),))
    with pytest.raises(MicrobatchError, match=r"chunk spec for argument 'args\[0\]' is a tuple"):
        split_args_kwargs((torch.zeros(2),), {}, 2, ((None,),))
    with pytest.raises(MicrobatchError, match=r"chunk spec for argument 'args\[0\]' is a dict"):
        split_args_kwargs(([torch.zeros(2)],), {}, 2, ({"a": None},))
    with pytest.raises(MicrobatchError, match=r"invalid chunk spec 'sum' for argument kwargs\['x'\]"):
        split_args_kwargs((), {"x": torch.zeros(2)}, 2, kwargs_chunk_spec={"x": "sum"})


def test_custom_spec_wrong_count() -> None:
    msg = r"for argument kwargs\['ids'\] returned 1 values, expected a list of 3"
    with pytest.raises(MicrobatchError, match=msg):
        split_args_kwargs((), {"ids": [1, 2, 3]}, 3, kwargs_chunk_spec={"ids": lambda v, n: [v]})


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_bad_n(n) -> None:
    with pytest.raises(MicrobatchError, match="number of microbatches"):
        split_args_kwargs((torch.zeros(4),), {}, n)


def test_tensor_chunk_spec_validates_dim() -> None:
    with pytest.raises(TypeError):
        TensorChunkSpec(1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TensorChunkSpec(0).dim = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- #
# Merging
# --------------------------------------------------------------------------- #


def test_merge_reductions_and_none() -> None:
    outs = [
        {"logits": torch.ones(2, 3) * i, "loss": torch.tensor(float(i)), "n": i, "aux": None, "tag": "x"}
        for i in range(4)
    ]
    merged = merge_chunks(outs, {"loss": "mean", "n": "sum"})
    assert merged["logits"].shape == (8, 3)
    assert merged["loss"].item() == 1.5 and merged["n"] == 6
    assert merged["aux"] is None and merged["tag"] == "x"
    summed = merge_chunks([torch.tensor(2), torch.tensor(3)], "sum")
    assert summed.item() == 5
    assert merge_chunks([torch.tensor([1, 2]), torch.tensor([3, 4])], "mean").tolist() == [2.0, 3.0]
    assert merge_chunks([1.0, 2.0], lambda vs: max(vs)) == 2.0


def test_merge_scalars_by_default() -> None:
    # a floating 0-dim tensor (an HF model's own loss) is averaged over microbatches
    merged = merge_chunks([(torch.ones(2), torch.tensor(1.0)), (torch.ones(2), torch.tensor(2.0))])
    assert merged[1].item() == 1.5
    # other scalars must agree; the error names the schedule's option
    with pytest.raises(MicrobatchError, match=r"output\[1\] differs between microbatches.*\"sum\", \"mean\".*"
                                              r"output_merge_spec="):
        merge_chunks([(torch.ones(2), torch.tensor(1)), (torch.ones(2), torch.tensor(2))])
    assert merge_chunks([(torch.ones(1), 5), (torch.ones(1), 5)])[1] == 5


def test_merge_structure_mismatch_names_path() -> None:
    with pytest.raises(MicrobatchError, match=r"output\['h'\]: microbatch 1 produced a list"):
        merge_chunks([{"h": [torch.ones(1)]}, {"h": [torch.ones(1), torch.ones(1)]}])
    with pytest.raises(MicrobatchError, match=r"output\[0\]: microbatch 1 produced a NoneType"):
        merge_chunks([(torch.ones(1),), (None,)])
    with pytest.raises(MicrobatchError, match=r"output: cannot concatenate shapes"):
        merge_chunks([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(MicrobatchError, match=r"output\['s'\] is a str, cannot sum"):
        merge_chunks([{"s": "a"}, {"s": "b"}], {"s": "sum"})
    with pytest.raises(MicrobatchError, match="at least one"):
        merge_chunks([])


def test_merge_rebuilds_model_output_type() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    out_type = modeling_outputs.CausalLMOutputWithPast
    outs = [out_type(loss=torch.tensor(float(i)), logits=torch.randn(2, 5, 7)) for i in range(3)]
    merged = merge_chunks(outs, {"loss": "mean"})
    assert type(merged) is out_type
    assert merged.logits.shape == (6, 5, 7) and merged.loss.item() == 1.0
    assert merged.past_key_values is None


def test_merge_rebuilds_namedtuple_and_registered_class() -> None:
    merged = merge_chunks([Pair(torch.ones(1), Box(torch.zeros(2), "k"))] * 2)
    assert isinstance(merged, Pair) and isinstance(merged.right, Box)
    assert merged.left.shape == (2,) and merged.right.a.shape == (4,) and merged.right.b == "k"


def test_docstring_examples() -> None:
    failures, attempted = doctest.testmod(microbatch)
    assert attempted > 0 and failures == 0
