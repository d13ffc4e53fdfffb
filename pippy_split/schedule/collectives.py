"""The few collectives a schedule runs besides its actions' point-to-point messages.

Part of the schedule layer (… → **schedule** → runtime), used by
:class:`~pippy_split.schedule.schedules.PipelineSchedule`: at construction, the
check that every rank built the same lowered order, and
the links of hand-built stages; every step, the batch's item count
(``loss_count``) and the summed gradient of tied parameters; and the
step's loss, which travels point to point. Each is a plain function of what it needs (the
:class:`~pippy_split.stage.groups.PipelineGroup`, tensors), so none reaches into a schedule or a stage.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..stage.errors import PipelineError
from ..stage.groups import PipelineGroup
from ..stage.loss import LossRule
from ..stage.transport import P2P
from .actions import Order
from .deps import Link
from .errors import ScheduleError

if TYPE_CHECKING:
    from ..stage.pipe_view import PipeView
    from ..stage.stage import PipelineStage

__all__ = ["agree_on_order", "gather_links", "item_count", "refuse_no_items", "share_loss",
           "sync_shared_grads"]



def agree_on_order(name: str, lowered: Order, n_microbatches: int, num_stages: int, links: Sequence[Link],
                   pg: PipelineGroup) -> None:
    """Every rank must run the same lowered order (else messages would pair up wrongly).
    One small all-gather of a fingerprint, also the group's first collective, which
    NCCL needs before batched point-to-point calls among a subset of ranks."""
    text = f"{n_microbatches}|{num_stages}|{sorted(links)}|" + ";".join(
        ",".join(str(a) for a in lowered[r] if a is not None) for r in sorted(lowered))
    mine = torch.tensor([zlib.crc32(text.encode()), n_microbatches], dtype=torch.int64, device=pg.device)
    every = [torch.empty_like(mine) for _ in range(pg.world)]
    dist.all_gather(every, mine, group=pg.group)
    prints = [tuple(t.tolist()) for t in every]
    if len(set(prints)) > 1:
        groups: dict[tuple, list[int]] = {}
        for r, fp in enumerate(prints):
            groups.setdefault(fp, []).append(r)
        detail = "; ".join(f"ranks {rs} (n_microbatches={fp[1]})" for fp, rs in groups.items())
        raise ScheduleError(f"{name}: the ranks built different schedules: {detail}. Every rank "
                            "must pass the same schedule class, n_microbatches, order and stage layout", rank=pg.rank)


def gather_links(mine: Sequence[Link], pg: PipelineGroup) -> list[Link]:
    """Hand-built stages declare their own skips: every rank shares its stages'
    links once (a small int tensor), so all ranks lower the same order."""
    if pg.world == 1:
        return sorted(set(mine))
    width = 256
    if len(mine) > width:
        raise ValueError(f"rank {pg.rank}: more than {width} links from its stages")
    buf = torch.full((width, 3), -1, dtype=torch.int64)
    if mine:
        buf[: len(mine)] = torch.tensor([[s, d, int(g)] for s, d, g in mine])
    gathered = [torch.empty_like(buf) for _ in range(pg.world)]
    dist.all_gather(gathered, buf, group=pg.group)
    return sorted({(int(s), int(d), bool(g)) for t in gathered for s, d, g in t.tolist() if s >= 0})


def item_count(loss_count: Callable[[Any], Any], targets: list, where: str) -> torch.Tensor:
    """The batch's item count (``loss_count`` over every microbatch's target), summed where the
    counts are (no host read); the last stage's rank shares it with the step's agreement
    (:func:`.agree.agree_before_step`). A failing ``loss_count`` is a :class:`PipelineError`
    naming the microbatch."""
    counts: list[torch.Tensor] = []
    for mb, t in enumerate(targets):
        try:
            counts.append(torch.as_tensor(loss_count(t), dtype=torch.float64).reshape(()))
        except Exception as e:
            raise PipelineError(f"{where}, microbatch {mb}: loss_count raised {type(e).__name__}: {e}") from e
    return torch.stack([c.to(counts[0].device) for c in counts]).sum()


def refuse_no_items(items: float, where: str) -> None:
    """Every rank alike: a batch whose ``loss_count`` is not positive has nothing to average over."""
    if not items > 0:
        raise PipelineError(f"{where}: loss_count gives {items:g} items for the whole batch; there is nothing to "
                            "average the loss over — check the padding value it looks for, or drop loss_count for "
                            "a mean over microbatches")


def share_loss(mb_losses: list, rule: LossRule | None, pg: PipelineGroup, src_rank: int,
               transport: P2P | None) -> torch.Tensor:
    """The step's loss (:meth:`LossRule.step_loss`), sent from where the last stage lives to
    every other rank (zero where no loss was computed): one point-to-point message per rank,
    after every message of the step's order, so it is the last message between each pair
    of ranks and NCCL's k-th-send-to-k-th-receive pairing holds. No collective: the ranks
    that exchange nothing with the last stage's rank are not made to wait for one another."""
    known = rule is not None and bool(mb_losses) and all(loss is not None for loss in mb_losses)
    value = rule.step_loss(mb_losses) if known and rule is not None else torch.zeros(())
    value = value.to(torch.float32).clone()
    if pg.world == 1 or transport is None:
        return value
    value = value.to(pg.device)
    if pg.rank == src_rank:
        sends = [P2P.send_op(value, r, f"rank {src_rank} sending the step's loss to rank {r}")
                 for r in range(pg.world) if r != src_rank]
        transport.wait(transport.post(sends))  # waited: a step leaves no work outstanding
        return value
    op, _ = P2P.recv_op((), torch.float32, pg.device, src_rank,
                        f"rank {pg.rank} waiting for the step's loss from rank {src_rank} (the last stage's)")
    transport.post([op])
    return transport.wait_recv(op)


def sync_shared_grads(pipe: PipeView | None, stages: Sequence[PipelineStage], pg: PipelineGroup) -> None:
    """Tied parameters held by several stages end the step with the summed gradient.

    Each rank sums its own holders' gradients and the pipeline group all-reduces that sum
    (zeros where a rank holds none). A holder sharded by FSDP2 or TP (a DTensor) takes
    part with its local shard: the holders of one tied parameter on the ranks of a
    pipeline group sit at the same place of their data-parallel meshes, so their shards
    cover the same elements, and summing the shards is summing the gradient. The shards'
    sizes are agreed first in one small all-reduce (a rank without a holder learns the
    size there), which also finds holders sharded differently and refuses them by name on
    every rank: their sum would be wrong.
    """
    if pipe is None or not pipe.shared_parameters:
        return
    mine = {st.stage_index: st for st in stages}
    tied = sorted(pipe.shared_parameters.items())
    local: list[list[torch.nn.Parameter]] = []
    for _fqn, holders in tied:
        held = {id(p): p for p in (mine[s].module.get_parameter(names[0]) for s, names in holders if s in mine)}
        local.append(list(held.values()))
    sizes = _agreed_shard_sizes([fqn for fqn, _ in tied], local, pg)
    for (_fqn, holders), params, numel in zip(tied, local, sizes):
        ref = pipe.stages[holders[0][0]].module.get_parameter(holders[0][1][0])  # its dtype, known on every rank
        shards = [_local_part(p.grad) for p in params if p.grad is not None]
        total = torch.zeros(numel, dtype=ref.dtype, device=pg.device)
        for g in shards:
            total += g.reshape(-1)
        if pg.world > 1:
            dist.all_reduce(total, group=pg.group)
        for p in params:
            shape = _local_part(p).shape
            if not isinstance(p.grad, DTensor):
                p.grad = _with_shape_of(p, total.view(shape).clone() if len(params) > 1 else total.view(shape))
            else:
                with torch.no_grad():
                    _local_part(p.grad).copy_(total.view(shape))


def _local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, not a copy), or a plain tensor as it is."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # no autograd wrapper: to_local() returns the shard itself
        return t.to_local()


def _with_shape_of(p: torch.nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``p`` from its local part: a DTensor like ``p`` where ``p`` is one."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _shard_key(p: torch.Tensor) -> int:
    """Where ``p``'s local part sits in the whole parameter: a DTensor's placements, mesh
    coordinate and local shape (a plain tensor: its shape), as one number."""
    if isinstance(p, DTensor):
        text = f"{tuple(p.shape)}|{p.placements}|{p.device_mesh.get_coordinate()}|{tuple(_local_part(p).shape)}"
    else:
        text = f"{tuple(p.shape)}|whole"
    return zlib.crc32(text.encode())


def _agreed_shard_sizes(fqns: Sequence[str], local: Sequence[Sequence[torch.nn.Parameter]],
                        pg: PipelineGroup) -> list[int]:
    """Each tied parameter's local size, agreed by every rank of the pipeline group (one all-reduce of
    small ints: the largest and smallest size and shard key among the holders); a PipelineError on
    every rank where two holders are sharded differently."""
    low = -(2**62)  # a rank holding none of a parameter takes no part in its max and min
    rows = []
    for params in local:
        sizes = [_local_part(p).numel() for p in params]
        keys = [_shard_key(p) for p in params]
        rows.append([max(sizes, default=low), -min(sizes, default=-low), max(keys, default=low),
                     -min(keys, default=-low)])
    agreed = torch.tensor(rows, dtype=torch.int64, device=pg.device).reshape(len(local), 4)
    if pg.world > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=pg.group)
    out = []
    for fqn, (big, neg_small, key_hi, neg_key_lo) in zip(fqns, agreed.tolist()):
        if big != -neg_small or key_hi != -neg_key_lo:
            raise PipelineError(f"the tied parameter {fqn} is sharded differently by the stages holding it (local "
                                f"sizes {-neg_small}..{big}): their gradients cannot be summed exactly. Shard every "
                                "holder alike (the same FSDP2 / TP on each stage root, the same data-parallel "
                                "mesh position), or untie it")
        out.append(big)
    return out
