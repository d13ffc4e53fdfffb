"""Each microbatch's dynamic sizes, known on every rank before the first message of a step.

Part of the schedule layer (… → **schedule** → runtime). A pipe traced with dynamic
dims has symbolic edge shapes; a receive is sized from them and the values of the
symbols *for its own microbatch*, so microbatches of one step may differ (a sequence
length per microbatch). Every rank given model inputs reads the values off them and
checks them against the traced ranges (:func:`local_sizes`, no messages); one small
all-gather per step then tells every rank every microbatch's values
(:func:`share_sizes`) and stops every rank alike where two ranks read different
values. Sizes never travel in a header on the data channels: NCCL pairs the k-th
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

__all__ = ["local_sizes", "inputs_given_anyway", "share_sizes", "message_bytes"]

if TYPE_CHECKING:
    from ..stage.pipe_view import PipeView

Bindings = dict[sympy.Symbol, int]


def local_sizes(symbols: Sequence[SymbolSource], flat_inputs: list[list[Any]] | None, n_microbatches: int,
                input_names: Sequence[str]) -> torch.Tensor:
    """``(n_microbatches, len(symbols))`` sizes this rank reads off its microbatches
    (-1 where it has none), each checked against the range it was traced for.

    Example:
        >>> s = SymbolSource(sympy.Symbol("T"), 0, 1, lower=2, upper=64)
        >>> local_sizes([s], [[torch.zeros(2, 16)], [torch.zeros(2, 8)]], 2, ["idx"]).tolist()
        [[16], [8]]
    """
    values = torch.full((n_microbatches, len(symbols)), -1, dtype=torch.int64)
    if flat_inputs is None:
        return values
    for mb, flat in enumerate(flat_inputs):
        for j, s in enumerate(symbols):
            size = int(flat[s.input_index].shape[s.dim])
            if not s.allows(size):
                name = input_names[s.input_index] if s.input_index < len(input_names) else f"input {s.input_index}"
                raise PipelineError(f"microbatch {mb}: input {name!r} has size {size} in dim {s.dim} ({s.symbol}), "
                                    f"outside the range {s.range_text()} the pipe was traced for; trace with a "
                                    f"Dim whose min/max cover it (dynamic_shapes= in pipeline())")
            values[mb, j] = size
    return values


def inputs_given_anyway(pipe: PipeView, args: tuple, kwargs: dict, n: int, args_chunk_spec: Any = None,
                        kwargs_chunk_spec: Any = None) -> list | None:
    """A rank that reads no model input but was given them (every rank loading the same batch,
    the usual torchrun script) still reports their sizes, so ranks whose data differ (an
    unseeded loader) are caught before any message; inputs it cannot split are ignored.
    Returns each microbatch's flat inputs (for :func:`local_sizes`), or ``None``."""
    if not args and not kwargs:
        return None
    try:
        mbs = split_args_kwargs(tuple(args), dict(kwargs), n, args_chunk_spec, kwargs_chunk_spec,
                                names=pipe.arg_names)
        return [pipe.flatten_inputs(a, k) for a, k in mbs]
    except (TypeError, ValueError):
        return None


def share_sizes(symbols: Sequence[SymbolSource], mine: torch.Tensor, pg: PipelineGroup) -> list[Bindings]:
    """Every microbatch's ``{symbol: size}`` on every rank: one all-gather of each rank's
    :func:`local_sizes` (ranks without inputs send -1). Ranks given inputs must agree;
    where they do not, every rank raises the same error before any message."""
    if pg.world > 1:
        every = [torch.empty_like(mine, device=pg.device) for _ in range(pg.world)]
        dist.all_gather(every, mine.to(pg.device), group=pg.group)
        gathered = [t.cpu() for t in every]
    else:
        gathered = [mine]
    given = [r for r, t in enumerate(gathered) if bool((t >= 0).all())]
    if not given:
        raise PipelineError("no rank was given the model inputs this step, so the dynamic sizes are unknown")
    ref = gathered[given[0]]
    for r in given[1:]:
        diff = (gathered[r] != ref).nonzero().tolist()
        if diff:
            mb, j = diff[0]
            raise PipelineError(f"ranks {given[0]} and {r} were given different inputs: microbatch {mb} has "
                                f"{symbols[j].symbol}={int(ref[mb, j])} on rank {given[0]} and "
                                f"{int(gathered[r][mb, j])} on rank {r}; every rank reading model inputs "
                                "must get the same microbatches")
    return [{s.symbol: int(v) for s, v in zip(symbols, row)} for row in ref.tolist()]


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
