"""The shape handshake of hand-built stages: what a stage built without a Pipe receives
and sends, learned once, before the first step's actions.

Part of the runtime (… → schedule → **runtime**): stages made with
``PipelineStage(module, ...)`` know only whom they send to (``outputs_to``, else the
next stage). On the first step every stage, in index order, runs a fake
(FakeTensor) forward of microbatch 0 (a real one under ``no_grad`` where the module
is FSDP2-wrapped or holds DTensors, which a fake forward cannot run) and its rank
broadcasts the outputs' specs as plain int64 metadata; each receiving stage builds its input slots from them. A
collective sequence every rank runs identically, so no point-to-point message
depends on it. The stages' slots and routes are :class:`~pippy_split.split.spec.StageInput`
and :class:`~pippy_split.split.spec.Edge`, as for a Pipe's stages.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..split.spec import Edge, InputKind, StageInput, TensorSpec
from ..stage.data_parallel import holds_sharded_state
from ..stage.errors import PipelineError
from ..stage.stage import PipelineStage
from ..stage.transport import P2P

__all__ = ["infer_manual_shapes", "refuse_unequal_microbatches"]


def infer_manual_shapes(stages: Mapping[int, PipelineStage], stage_rank: Mapping[int, int], rank: int,
                        p2p: P2P | None, ctx: Any) -> None:
    """Every stage in index order works out its outputs' shapes with a fake forward
    (no compute, no memory) and its rank broadcasts them: a collective sequence that
    every rank runs identically, so no point-to-point message depends on it."""
    described: dict[int, list[tuple[int, int, int, TensorSpec]]] = {}
    device = next(iter(stages.values())).device
    for s in range(len(stage_rank)):
        owner = stage_rank[s]
        header = None
        if owner == rank:
            stage = stages[s]
            if stage.in_slots is None:
                stage.set_links(in_slots=_build_slots(stage, described.get(s, [])))
            if not stage.routes:
                outs = _real_outputs(stage, ctx) if holds_sharded_state(stage.module) else _fake_outputs(stage, ctx)
                stage.set_links(routes=_manual_routes(stage, outs))
            header = _encode_routes(stage.routes).to(device)
        if p2p is not None:
            if header is None:
                header = torch.empty(1 + _HEADER_ROWS * _HEADER_COLS, dtype=torch.int64, device=device)
            dist.broadcast(header, group=p2p.group, group_src=owner)
        if header is not None:
            for src, out, dst_in, spec, dst in _decode_routes(header.cpu(), s):
                described.setdefault(dst, []).append((src, out, dst_in, spec))


_HEADER_ROWS, _HEADER_COLS, _MAX_DIMS = 32, 16, 8  # a row: 6 fields + up to 8 dims
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _encode_routes(routes: list[Edge]) -> torch.Tensor:
    """Plain int64 metadata (no pickling): count, then per route
    [src_output, dst_input, ndim, dtype code, requires_grad, dims...]."""
    if len(routes) > _HEADER_ROWS:
        raise PipelineError(f"a hand-built stage can send at most {_HEADER_ROWS} tensors to one stage")
    header = torch.zeros(1 + _HEADER_ROWS * _HEADER_COLS, dtype=torch.int64)
    header[0] = len(routes)
    for k, r in enumerate(routes):
        if len(r.spec.shape) > _MAX_DIMS or r.spec.dtype not in _DTYPES:
            raise PipelineError(f"output {r.src_output} of a hand-built stage has more than {_MAX_DIMS} dims or an "
                                f"unsupported dtype {r.spec.dtype} (supported: {_DTYPES}); build the stages with "
                                "pipeline() instead")
        row = [r.src_output, r.dst_input, r.dst_stage, len(r.spec.shape), _DTYPES.index(r.spec.dtype),
               int(r.spec.requires_grad), *r.spec.shape]
        header[1 + k * _HEADER_COLS: 1 + k * _HEADER_COLS + len(row)] = torch.tensor(row)
    return header


def _decode_routes(header: torch.Tensor, src: int) -> list[tuple[int, int, int, TensorSpec, int]]:
    """``(src stage, src output, dst input, spec, dst stage)`` per route in the header."""
    out = []
    for k in range(int(header[0])):
        row = header[1 + k * _HEADER_COLS: 1 + (k + 1) * _HEADER_COLS].tolist()
        ndim = row[3]
        spec = TensorSpec(tuple(row[6:6 + ndim]), _DTYPES[row[4]], bool(row[5]))
        out.append((src, row[0], row[1], spec, row[2]))
    return out


def _build_slots(stage: PipelineStage, described: list[tuple[int, int, int, TensorSpec]]) -> list[StageInput]:
    """Slots of a hand-built stage: declared positions first, chain values fill the rest in order."""
    fixed = {d: (src, out, spec) for src, out, d, spec in described if d >= 0}
    chain = sorted(((out, src, spec) for src, out, d, spec in described if d < 0))
    n = len(fixed) + len(chain)
    slots, free = [], iter(i for i in range(n) if i not in fixed)
    placed = dict(fixed)
    for out, src, spec in chain:
        placed[next(free)] = (src, out, spec)
    for i in range(n):
        if i not in placed:
            raise PipelineError(f"stage {stage.stage_index}: nothing is sent to input {i}")
        src, out, spec = placed[i]
        slots.append(StageInput(i, InputKind.EDGE, edge=Edge(src, out, stage.stage_index, i, spec)))
    return slots


def _fake_outputs(stage: PipelineStage, ctx: Any) -> tuple:
    """The stage's outputs for microbatch 0 under FakeTensorMode: shapes, dtypes and
    requires-grad of the real ones, without computing anything or touching the real
    parameters and buffers (BatchNorm statistics stay as they are)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state: dict[str, torch.Tensor] = {
        n: mode.from_tensor(t) for n, t in [*stage.module.named_parameters(), *stage.module.named_buffers()]}
    if stage.is_first:
        args = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in ctx.mb_args[0]]
        kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in ctx.mb_kwargs[0].items()}
    else:
        specs = [slot.spec for slot in stage.in_slots or []]  # built just before, every one an edge's
        with mode:
            args = [torch.empty(spec.shape, dtype=spec.dtype, device=stage.device).requires_grad_(spec.carries_grad)
                    for spec in specs if spec is not None]
        kwargs = {}
    try:
        with mode, torch.enable_grad():
            out = torch.func.functional_call(stage.module, state, tuple(args), kwargs)
    except Exception as e:
        raise PipelineError(f"stage {stage.stage_index}: could not work out the shapes of this hand-built stage's "
                            f"outputs with a fake forward ({type(e).__name__}: {e}); build the stages with "
                            "pipeline() so the shapes come from the trace") from e
    return tuple(out) if isinstance(out, tuple) else (out,)


def _real_outputs(stage: PipelineStage, ctx: Any) -> tuple:
    """The outputs of a stage whose module is sharded (FSDP2, DTensor): one real forward of
    microbatch 0 (zeros for a later stage's inputs) under ``no_grad``, through the module's
    own hooks, so FSDP all-gathers and reshards as in any forward (every data-parallel and
    tensor-parallel peer runs it at the same point of the first step). The RNG state and the
    buffers (BatchNorm statistics) are put back afterwards. Under ``no_grad`` no output
    requires grad: an output carries a gradient when it is float/complex and a parameter
    or an input of the stage does."""
    if stage.is_first:
        args, kwargs = tuple(ctx.mb_args[0]), dict(ctx.mb_kwargs[0])
    else:
        specs = [slot.spec for slot in stage.in_slots or [] if slot.spec is not None]
        args, kwargs = tuple(torch.zeros(spec.shape, dtype=spec.dtype, device=stage.device) for spec in specs), {}
    grad_in = any(p.requires_grad for p in stage.module.parameters()) or any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())) or any(
        slot.spec is not None and slot.spec.carries_grad for slot in stage.in_slots or [])
    buffers = [(b, b.detach().clone()) for b in stage.module.buffers()]
    devices = [stage.device] if stage.device.type not in ("cpu", "meta") else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=stage.device.type if devices else "cuda"), \
                torch.no_grad():
            out = stage.module(*args, **kwargs)
            for b, saved in buffers:
                b.copy_(saved)
    except Exception as e:
        raise PipelineError(f"stage {stage.stage_index}: could not work out the shapes of this hand-built stage's "
                            f"outputs with a no-grad forward of microbatch 0 (its module is FSDP2-wrapped or holds "
                            f"DTensors; {type(e).__name__}: {e})") from e
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    return tuple(_RealOut(o, grad_in) if isinstance(o, torch.Tensor) else o for o in outs)


class _RealOut:
    """Shape, dtype and requires-grad of a real output computed under ``no_grad``."""

    def __init__(self, out: torch.Tensor, grad_in: bool) -> None:
        self.shape, self.dtype = tuple(out.shape), out.dtype
        self.requires_grad = grad_in and (out.dtype.is_floating_point or out.dtype.is_complex)


def _manual_routes(stage: PipelineStage, outs: tuple) -> list[Edge]:
    """Routes (outgoing edges) of a hand-built stage, from its declared outputs_to and the chain."""
    routes = []
    for i, out in enumerate(outs):
        dsts = stage.outputs_to[i] if i in stage.outputs_to else [] if stage.is_last else [(stage.stage_index + 1, -1)]
        if dsts and not isinstance(out, (torch.Tensor, _RealOut)):
            raise PipelineError(f"output {i} sent to stage {dsts[0][0]} is not a tensor")
        for dst, dst_in in dsts:
            routes.append(Edge(stage.stage_index, i, dst, dst_in,
                               TensorSpec(tuple(out.shape), out.dtype, bool(out.requires_grad))))
    return routes


def refuse_unequal_microbatches(mb_args: list[tuple], mb_kwargs: list[dict]) -> None:
    """Hand-built stages learn one set of shapes on the first step, so every microbatch must have them."""
    def shapes(a: tuple, k: dict) -> list:
        return [tuple(x.shape) for x in pytree.tree_leaves((a, k)) if isinstance(x, torch.Tensor)]

    first = shapes(mb_args[0], mb_kwargs[0] if mb_kwargs else {})
    for mb in range(1, len(mb_args)):
        got = shapes(mb_args[mb], mb_kwargs[mb] if mb_kwargs else {})
        if got != first:
            raise PipelineError(f"microbatch {mb} has input shapes {got}, microbatch 0 {first}: hand-built stages "
                                "learn one set of shapes on the first step, so their microbatches must agree; for "
                                "microbatches of different lengths trace the model with ps.pipeline(..., "
                                "dynamic_shapes=...) and build the stages from the pipe")
