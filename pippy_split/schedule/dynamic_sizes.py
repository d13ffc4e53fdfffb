"""Each microbatch's dynamic sizes, known on every rank before the first message of a step.

Part of the schedule layer (… → **schedule** → runtime). A pipe traced with dynamic
dims has symbolic edge shapes; a receive is sized from them and the values of the
symbols *for its own microbatch*, so microbatches of one step may differ (a sequence
length per microbatch). Every rank given model inputs reads the values off them and
checks them against the traced ranges (:class:`SizeReader`, no messages); the step's
one agreement (an all-reduce, :func:`.agree.agree_before_step`) then tells every rank
every microbatch's values (:func:`share_sizes`) and stops every rank alike where two
ranks read different values. Sizes never travel in a header on the data channels: NCCL pairs the k-th
send with the k-th receive, so a receive must know its size beforehand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.distributed as dist

from ..microbatch import split_args_kwargs
from ..split.spec import SymbolSource
from ..stage.errors import PipelineError
from ..stage.groups import PipelineGroup

__all__ = ["SizeReader", "inputs_given_anyway", "share_sizes", "message_bytes"]

if TYPE_CHECKING:
    from ..stage.model_io import ModelInputs

Bindings = dict[sympy.Symbol, int]


class SizeReader:
    """Reads each microbatch's dynamic sizes off its flat inputs and checks each against the
    range it was traced for (``SymbolSource.lower`` / ``upper``; ``upper`` None: unbounded).
    Made once per schedule from the pipe's symbols and input names; no messages.

    Example:
        >>> s = SymbolSource(sympy.Symbol("T"), 0, 1, lower=2, upper=64)
        >>> SizeReader([s], ["idx"])([[torch.zeros(2, 16)], [torch.zeros(2, 8)]], 2).tolist()
        [[16], [8]]
        >>> SizeReader([s], ["idx"])([[torch.zeros(2, 80)]], 1)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        PipelineError: microbatch 0: input 'idx' has size 80 in dim 1 (T), outside the range [2, 64] ...
    """

    def __init__(self, symbols: Sequence[SymbolSource], input_names: Sequence[str]) -> None:
        self.symbols = list(symbols)
        self._reads = [(s.input_index, s.dim, s.lower, s.upper, s.symbol,
                        input_names[s.input_index] if s.input_index < len(input_names) else f"input {s.input_index}")
                       for s in self.symbols]

    def __call__(self, flat_inputs: list[list[Any]] | None, n_microbatches: int) -> torch.Tensor:
        """``(n_microbatches, len(symbols))`` sizes this rank reads off its microbatches (-1 where
        it has none)."""
        values = torch.full((n_microbatches, len(self._reads)), -1, dtype=torch.int64)
        if flat_inputs is None:
            return values
        for mb, flat in enumerate(flat_inputs):
            for j, (index, dim, lower, upper, symbol, name) in enumerate(self._reads):
                size = int(flat[index].shape[dim])
                if size < lower or (upper is not None and size > upper):
                    raise PipelineError(f"microbatch {mb}: input {name!r} has size {size} in dim {dim} ({symbol}), "
                                        f"outside the range [{lower}, {'inf' if upper is None else upper}] the pipe "
                                        "was traced for; trace with a Dim whose min/max cover it (dynamic_shapes= "
                                        "in pipeline())")
                values[mb, j] = size
        return values


def inputs_given_anyway(model_inputs: ModelInputs, arg_names: Sequence[str] | None, args: tuple, kwargs: dict, n: int,
                        args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None) -> list | None:
    """A rank that reads no model input but was given them (every rank loading the same batch,
    the usual torchrun script) still reports their sizes, so ranks whose data differ (an
    unseeded loader) are caught before any message; inputs it cannot split are ignored.
    Returns each microbatch's flat inputs (for :class:`SizeReader`), or ``None``."""
    if not args and not kwargs:
        return None
    try:
        mbs = split_args_kwargs(tuple(args), dict(kwargs), n, args_chunk_spec, kwargs_chunk_spec, names=arg_names)
        return [model_inputs.flatten(a, k) for a, k in mbs]
    except (TypeError, ValueError):
        return None


def share_sizes(symbols: Sequence[SymbolSource], agreed: tuple[list[list[int]], list[list[int]]], mine: torch.Tensor,
                pg: PipelineGroup) -> list[Bindings]:
    """Every microbatch's ``{symbol: size}`` on every rank, from the step's agreement
    (:func:`.agree.agree_before_step`: the largest and smallest size each rank given inputs
    read). Ranks given inputs must agree; where they do not, every rank learns it from the
    same agreement, gathers each rank's :class:`SizeReader` (``mine``) to name the ranks, and
    raises the same error before any message."""
    most, least = agreed
    if not most or any(v < 0 for row in most for v in row):
        raise PipelineError("no rank was given the model inputs this step, so the dynamic sizes are unknown")
    if most != least:
        _refuse_different_inputs(symbols, mine, pg)
    return [{s.symbol: v for s, v in zip(symbols, row)} for row in most]


def _refuse_different_inputs(symbols: Sequence[SymbolSource], mine: torch.Tensor, pg: PipelineGroup) -> None:
    """Name two ranks given different inputs (one all-gather, only on this error path)."""
    every = [torch.empty_like(mine, device=pg.device) for _ in range(pg.world)]
    dist.all_gather(every, mine.to(pg.device), group=pg.group)
    gathered = [t.cpu() for t in every]
    given = [r for r, t in enumerate(gathered) if bool((t >= 0).all())]
    ref = gathered[given[0]]
    for r in given[1:]:
        diff = (gathered[r] != ref).nonzero().tolist()
        if diff:
            mb, j = diff[0]
            raise PipelineError(f"ranks {given[0]} and {r} were given different inputs: microbatch {mb} has "
                                f"{symbols[j].symbol}={int(ref[mb, j])} on rank {given[0]} and "
                                f"{int(gathered[r][mb, j])} on rank {r}; every rank reading model inputs "
                                "must get the same microbatches")
    raise PipelineError("the ranks given the model inputs read different dynamic sizes; every rank reading model "
                        "inputs must get the same microbatches")


def message_bytes(edges: Sequence[Any], bindings: Bindings) -> int:
    """Bytes one microbatch sends across the cuts (every edge once, forward direction) at
    these sizes: what a receive of that microbatch allocates, and a microbatch's weight
    for ``simulate(..., microbatch_scale=)``.

    Example:
        >>> from pippy_split.split.spec import Edge, TensorSpec
        >>> T = sympy.Symbol("T")
        >>> e = Edge(0, 0, 1, 0, TensorSpec((2, T, 8), torch.float32, True))
        >>> message_bytes([e], {T: 16}), message_bytes([e], {T: 8})
        (1024, 512)
    """
    total = 0
    for e in edges:
        shape = e.spec.concrete_shape(bindings)
        n = 1
        for d in shape:
            n *= int(d)
        total += n * e.spec.dtype.itemsize
    return total
