"""compat.microbatch against torch.distributed.pipelining.microbatch on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.pipelining.microbatch as peer
from torch.utils import _pytree as pytree

import pippy_split as ps
from pippy_split.compat import microbatch as compat_microbatch
from pippy_split.compat.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks


def _same(a, b) -> None:
    """Equal structure, equal tensors, equal other leaves."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        else:
            assert x == y


def _cases():
    torch.manual_seed(0)
    x0, x1, x2 = torch.randn(16, 3), torch.randn(32, 3), torch.randn(64, 3)
    yield "batch sizes differ per tensor", ((x0, x1, x2), {"x0": x0, "x2": x2}, 2, None, None)
    yield "uneven", ((torch.randn(7, 2),), {}, 3, None, None)
    yield "fewer chunks than asked", ((torch.randn(3, 2), torch.randn(6, 2)), {}, 4, None, None)
    yield "non-tensors replicated", ((torch.randn(4, 2), 3, "relu", None), {"flag": True}, 2, None, None)
    yield "specs from tuple and dict", ((torch.randn(2, 6),), {"m": torch.randn(6, 4)}, 3, (1,), {"m": 0})
    yield "kwargs spec only", ((torch.randn(4, 2),), {"m": torch.randn(4, 6)}, 2, None, {"m": 1})
    yield "nested list, a spec per leaf", (([torch.randn(4, 2), torch.randn(4, 6)],), {}, 2, ([1, 0],), None)
    yield "no tensors at all", ((1, 2), {}, 3, None, None)


@pytest.mark.parametrize("args, kwargs, n, arg_dims, kw_dims", [c for _, c in _cases()], ids=[i for i, _ in _cases()])
def test_split_like_the_peer(args, kwargs, n, arg_dims, kw_dims):
    def specs(mod):
        spec = mod.TensorChunkSpec
        a = None if arg_dims is None else tuple(
            [spec(d) for d in dims] if isinstance(dims, list) else spec(dims) for dims in arg_dims)
        return a, None if kw_dims is None else spec.from_dict(kw_dims)

    ours = split_args_kwargs_into_chunks(args, kwargs, n, *specs(compat_microbatch))
    theirs = peer.split_args_kwargs_into_chunks(args, kwargs, n, *specs(peer))
    assert isinstance(ours, tuple) and len(ours) == 2
    assert all(isinstance(a, tuple) for a in ours[0]) and all(isinstance(k, dict) for k in ours[1])
    _same(ours, theirs)


def test_split_args_none_kwargs():
    args, kwargs = split_args_kwargs_into_chunks((torch.ones(4, 1),), None, 2)
    assert kwargs == [{}, {}] and [a[0].shape[0] for a in args] == [2, 2]


def test_split_and_merge_round_trip_like_the_peer():
    torch.manual_seed(0)
    args = (torch.randn(8, 3), torch.randn(16, 3))
    kwargs = {"a": torch.randn(8, 3), "b": torch.randn(2, 24)}
    arg_chunks, kw_chunks = split_args_kwargs_into_chunks(args, kwargs, 4, None, {"b": TensorChunkSpec(1)})
    _same(merge_chunks(arg_chunks, TensorChunkSpec.from_tuple((0, 0))), args)
    _same(merge_chunks(kw_chunks, TensorChunkSpec.from_dict({"a": 0, "b": 1})), kwargs)
    peer_args, _ = peer.split_args_kwargs_into_chunks(args, kwargs, 4)
    _same(merge_chunks(arg_chunks, None), peer.merge_chunks(peer_args, None))


def test_tensor_chunk_spec_is_ours_with_the_peers_spelling():
    spec = TensorChunkSpec(1)
    assert spec.split_dim == 1 and spec.dim == 1 and repr(spec) == "TensorChunkSpec(1)"
    assert [s.split_dim for s in TensorChunkSpec.from_tuple((0, 2))] == [0, 2]
    assert {k: s.split_dim for k, s in TensorChunkSpec.from_dict({"y": 1}).items()} == {"y": 1}
    # usable where pippy_split's own specs are expected
    mbs = ps.split_args_kwargs((torch.zeros(3, 4),), {}, 2, (spec,))
    assert mbs[0][0][0].shape == (3, 2)


def test_spec_that_does_not_fit_is_named():
    with pytest.raises(ps.microbatch.MicrobatchError, match="args_chunk_spec has 1 entries"):
        split_args_kwargs_into_chunks((torch.ones(4), torch.ones(4)), {}, 2, (TensorChunkSpec(0),))
    with pytest.raises(ps.microbatch.MicrobatchError, match=r"kwargs\['m'\].*dim 3"):
        split_args_kwargs_into_chunks((), {"m": torch.ones(4)}, 2, None, {"m": TensorChunkSpec(3)})


def test_docstring_examples_run():
    import doctest

    from pippy_split.compat import microbatch

    failures, attempted = doctest.testmod(microbatch)
    assert attempted and not failures
