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


# ---- FlexAttention BlockMask: chunked along its batch, as the peer chunks it -------------------------


def _block_mask(batch: int):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = (torch.arange(batch * 256) % 30).reshape(batch, 256)  # packed documents of 30 tokens

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] // 7 == ids[b, kv_idx] // 7) & (q_idx >= kv_idx)

    return create_block_mask(same_doc_causal, B=batch, H=1, Q_LEN=256, KV_LEN=256, device="cpu")


def _mask_rows(mask) -> list:
    """A mask as plain data: its block tables, and what its mask_mod says for each of its batch rows."""
    b = torch.arange(mask.kv_num_blocks.shape[0])
    q_idx, kv_idx = torch.full_like(b, 200), torch.full_like(b, 150)
    return [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
            mask.mask_mod(b, torch.zeros_like(b), q_idx, kv_idx)]


@pytest.mark.parametrize("batch, chunks", [(6, 4), (4, 4), (1, 3)], ids=["uneven", "even", "batch 1 broadcasts"])
def test_block_mask_is_chunked_along_its_batch_like_the_peer(batch, chunks):
    """The peer's test_split_block_mask: a BlockMask inside an argument is cut along its batch, each
    piece's mask_mod told its batch offset (it was handed to every microbatch whole before)."""
    mask, q = _block_mask(batch), torch.randn(batch, 1, 256, 8)
    ours, _ = split_args_kwargs_into_chunks((q, {"block_mask": mask}), {}, chunks)
    theirs, _ = peer.split_args_kwargs_into_chunks((q, {"block_mask": mask}), {}, chunks)
    assert len(ours) == len(theirs)
    for mine, peers in zip(ours, theirs):
        _same(mine[0], peers[0])
        _same(_mask_rows(mine[1]["block_mask"]), _mask_rows(peers[1]["block_mask"]))
    if batch > 1:
        assert sum(m[1]["block_mask"].kv_num_blocks.shape[0] for m in ours) == batch


def test_block_mask_along_another_dim_is_refused_by_name():
    with pytest.raises(compat_microbatch.MicrobatchError, match="BlockMask.*batch \\(dim 0\\) only"):
        split_args_kwargs_into_chunks((), {"m": _block_mask(4)}, 2, kwargs_chunk_spec={"m": TensorChunkSpec(1)})
