"""``torch.distributed.pipelining.microbatch``'s names over :mod:`pippy_split.microbatch`.

Part of the drop-in (:mod:`pippy_split.compat`): the same split/merge helpers
under the peer's names, argument order and return shapes.

- ``TensorChunkSpec(split_dim)`` (with ``.split_dim``, ``from_tuple``, ``from_dict``)
  is a :class:`pippy_split.TensorChunkSpec`, so it works in our schedules too.
- ``split_args_kwargs_into_chunks`` returns ``(args_chunks, kwargs_chunks)``, two
  lists, and chunks every tensor on its own (``torch.tensor_split``): tensors of
  different batch sizes are fine, uneven batches give chunks that differ by one,
  and a tensor smaller than ``chunks`` gives that many chunks.
- a FlexAttention ``BlockMask`` is chunked along its batch as the peer chunks it (its block
  tables sliced, its ``mask_mod`` told each chunk's batch offset); one of batch 1 is given to
  every microbatch whole.
- ``merge_chunks(chunks, chunk_spec)`` is ours (``None`` = concatenate on dim 0).

Example:
    >>> args, kwargs = split_args_kwargs_into_chunks((torch.ones(4, 2),), {"m": torch.ones(6)}, 2)
    >>> [a[0].shape[0] for a in args], [k["m"].shape[0] for k in kwargs]
    ([2, 2], [3, 3])
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .. import microbatch as _core
from ..microbatch import MicrobatchError, Replicate

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks", "peer_chunk_specs"]


class TensorChunkSpec(_core.TensorChunkSpec):
    """Chunk tensors along ``split_dim`` (the peer's spelling of :class:`pippy_split.TensorChunkSpec`).

    Example:
        >>> TensorChunkSpec.from_tuple((0, 1))
        (TensorChunkSpec(0), TensorChunkSpec(1))
    """

    def __init__(self, split_dim: int) -> None:
        super().__init__(split_dim)

    @property
    def split_dim(self) -> int:
        return self.dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.dim})"

    __str__ = __repr__

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]) -> tuple["TensorChunkSpec", ...]:
        """One spec per positional argument: ``(0, 1)`` -> ``(TensorChunkSpec(0), TensorChunkSpec(1))``."""
        return tuple(TensorChunkSpec(d) for d in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: dict[str, int]) -> dict[str, "TensorChunkSpec"]:
        """One spec per keyword argument: ``{"y": 0}`` -> ``{"y": TensorChunkSpec(0)}``."""
        return {k: TensorChunkSpec(d) for k, d in chunk_dims.items()}


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
) -> tuple[list[tuple], list[dict]]:
    """Split a step's arguments into microbatches, each tensor on its own.

    Args:
        args: positional arguments.
        kwargs: keyword arguments (``None`` = none).
        chunks: number of microbatches wanted.
        args_chunk_spec: one spec per positional argument (a spec, or a pytree of
            specs matching the argument); default ``TensorChunkSpec(0)`` for tensors.
        kwargs_chunk_spec: ``{name: spec}``; missing names use the default.

    Returns:
        ``(args_split, kwargs_split)``: a list of argument tuples and a list of
        keyword dicts, one per microbatch. Fewer than ``chunks`` when a chunked
        tensor is smaller than ``chunks`` along its dimension. Non-tensors (and
        0-dim tensors) are the same object in every microbatch.

    Raises:
        MicrobatchError: a spec that does not fit its argument, or a dimension a
            tensor does not have.

    Example:
        >>> a, k = split_args_kwargs_into_chunks((torch.ones(5, 3), "relu"), None, 2)
        >>> [c[0].shape[0] for c in a], a[1][1], k
        ([3, 2], 'relu', [{}, {}])
    """
    kwargs = {} if kwargs is None else kwargs
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise MicrobatchError(f"chunks must be an int >= 1, got {chunks!r}")
    arg_trees, kw_trees, dims = _per_tensor_specs(args, kwargs, args_chunk_spec, kwargs_chunk_spec)
    n = min([chunks] + [t.shape[d] for _, t, d in dims])
    mbs = _core.split_args_kwargs(tuple(args), dict(kwargs), max(n, 1), arg_trees, kw_trees)
    return [a for a, _ in mbs], [k for _, k in mbs]


def peer_chunk_specs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    chunks: int,
    args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Chunk specs under which :func:`pippy_split.microbatch.split_args_kwargs` splits these
    inputs as the peer's schedules do: each tensor by its own size along its dim, so a keyword
    argument of 8 rows beside positional ones of 64 is fine (pippy_split's own schedules
    require chunked arguments to agree). The compat schedules split ``step()``'s inputs so.

    Args:
        args / kwargs: one step's inputs.
        chunks: the schedule's microbatches.
        args_chunk_spec / kwargs_chunk_spec: the schedule's specs, as for
            :func:`split_args_kwargs_into_chunks`.

    Returns:
        ``(args_spec, kwargs_spec)``: a per-tensor chunker at every chunked tensor,
        ``Replicate`` elsewhere, shaped like the inputs.

    Raises:
        MicrobatchError: a spec that does not fit its argument, or a chunked tensor with
            fewer than ``chunks`` entries along its dim (the peer cannot run that step either).

    Example:
        >>> x, m = torch.ones(64, 2), torch.ones(8, 2)
        >>> specs = peer_chunk_specs((x,), {"m": m}, 4)
        >>> [(a[0].shape[0], k["m"].shape[0]) for a, k in _core.split_args_kwargs((x,), {"m": m}, 4, *specs)]
        [(16, 2), (16, 2), (16, 2), (16, 2)]
    """
    arg_trees, kw_trees, dims = _per_tensor_specs(args, kwargs, args_chunk_spec, kwargs_chunk_spec)
    for where, t, d in dims:
        if t.shape[d] < chunks:
            raise MicrobatchError(f"{where} has shape {tuple(t.shape)}: {t.shape[d]} entries along dim {d}, fewer "
                                  f"than the step's {chunks} microbatches")
    return arg_trees, kw_trees


def _per_tensor_specs(args: tuple[Any, ...], kwargs: dict[str, Any], args_chunk_spec: Any,
                      kwargs_chunk_spec: Any) -> tuple[tuple[Any, ...], dict[str, Any], list]:
    """Spec trees that chunk every tensor on its own (see :func:`_leaf_specs`), and every
    chunked tensor as ``(where, tensor, dim)``."""
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise MicrobatchError(f"args_chunk_spec has {len(args_chunk_spec)} entries but {len(args)} positional "
                              "arguments were given")
    arg_specs = [None if args_chunk_spec is None else args_chunk_spec[i] for i in range(len(args))]
    kw_specs = {k: (kwargs_chunk_spec or {}).get(k) for k in kwargs}
    dims: list[tuple[str, torch.Tensor, int]] = []  # every chunked tensor: (where, tensor, dim)
    arg_trees = tuple(_leaf_specs(a, s, f"args[{i}]", dims) for i, (a, s) in enumerate(zip(args, arg_specs)))
    kw_trees = {k: _leaf_specs(v, kw_specs[k], f"kwargs[{k!r}]", dims) for k, v in kwargs.items()}
    return arg_trees, kw_trees, dims


def _leaf_specs(value: Any, spec: Any, where: str, dims: list) -> Any:
    """A spec tree shaped like ``value``: a per-tensor chunker at each chunked tensor,
    ``Replicate`` elsewhere (our splitter then never compares batch sizes)."""
    leaves, treespec = pytree.tree_flatten(value, is_leaf=_is_block_mask)
    if spec is None or spec is Replicate or isinstance(spec, _core.TensorChunkSpec):
        specs = [spec] * len(leaves)
    else:
        specs = pytree.tree_leaves(spec, is_leaf=lambda s: s is None or isinstance(s, _core.TensorChunkSpec))
        if len(specs) != len(leaves):
            raise MicrobatchError(f"chunk spec for {where} has {len(specs)} entries but the argument has "
                                  f"{len(leaves)} values")
    out: list[Any] = []
    for k, (leaf, s) in enumerate(zip(leaves, specs)):
        if _is_block_mask(leaf) and s is not Replicate:
            out.append(_block_mask_chunker(leaf, s, f"{where} (value {k})", dims))
            continue
        if not isinstance(leaf, torch.Tensor) or s is Replicate or (s is None and leaf.dim() == 0):
            out.append(Replicate)
            continue
        dim = 0 if s is None else s.dim
        if not -leaf.dim() <= dim < leaf.dim():
            raise MicrobatchError(f"{where} (value {k}) has shape {tuple(leaf.shape)}, cannot chunk along dim {dim}")
        dims.append((where, leaf, dim))
        out.append(functools.partial(_chunk, dim=dim))
    return pytree.tree_unflatten(out, treespec) if treespec.num_leaves else Replicate


def _chunk(t: torch.Tensor, n: int, *, dim: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(t, n, dim=dim))


def _is_block_mask(value: Any) -> bool:
    return type(value).__name__ == "BlockMask" and hasattr(value, "kv_num_blocks")


def _block_mask_chunker(mask: Any, spec: Any, where: str, dims: list) -> Any:
    """The chunker of a ``BlockMask`` argument: along its batch (dim 0, the only dim the peer
    chunks it on); a mask of batch 1 broadcasts, so every microbatch gets it whole."""
    if spec is not None and spec.dim != 0:
        raise MicrobatchError(f"{where} is a BlockMask, which is chunked along its batch (dim 0) only, "
                              f"not dim {spec.dim}")
    if mask.kv_num_blocks.size(0) == 1:
        return Replicate
    dims.append((where, mask.kv_num_blocks, 0))
    return _chunk_block_mask


def _chunk_block_mask(mask: Any, n: int) -> list[Any]:
    """``mask`` cut into ``n`` masks along its batch, as the peer cuts it: each keeps its rows of
    the block tables and a ``mask_mod`` that sees the batch index it had in the whole mask."""
    from torch.nn.attention.flex_attention import BlockMask

    def rows(t: torch.Tensor | None) -> list:
        return list(torch.tensor_split(t, n, 0)) if t is not None else [None] * n

    def shifted(offset: int) -> Callable:
        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return mask.mask_mod(b + torch.full_like(b, offset), h, q_idx, kv_idx)
        return mask_mod

    num, idx = rows(mask.kv_num_blocks), rows(mask.kv_indices)
    full_num, full_idx = rows(mask.full_kv_num_blocks), rows(mask.full_kv_indices)
    out, offset = [], 0
    for i in range(n):
        out.append(BlockMask.from_kv_blocks(kv_num_blocks=num[i], kv_indices=idx[i], full_kv_num_blocks=full_num[i],
                                            full_kv_indices=full_idx[i], BLOCK_SIZE=mask.BLOCK_SIZE,
                                            mask_mod=shifted(offset), seq_lengths=mask.seq_lengths))
        offset += num[i].size(0)
    return out


def merge_chunks(chunks: list[Any], chunk_spec: Any) -> Any:
    """Merge per-microbatch values into one (:func:`pippy_split.merge_chunks`).

    Args:
        chunks: one value per microbatch, in order.
        chunk_spec: ``None`` (tensors concatenated on dim 0), a ``TensorChunkSpec``,
            or a tuple/dict of them shaped like the values.

    Returns:
        The merged value, in the values' own structure.

    Example:
        >>> merge_chunks([torch.ones(2, 1), torch.zeros(2, 1)], TensorChunkSpec(1)).shape
        torch.Size([2, 2])
    """
    return _core.merge_chunks(chunks, chunk_spec)
