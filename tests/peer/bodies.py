"""Rank bodies and models of the peer tests (top-level so that the ranks can pickle them).

Each body runs torch.distributed.pipelining (the peer) on its rank and returns what the
test asserts on; the traced-pipe cases reuse ``benchmarks.traffic`` / ``benchmarks.common``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from benchmarks import common

D = 8
BATCH = 8
N_MB = 4


class Block(torch.nn.Module):
    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (mb, D) -> (mb, D)
        h = torch.tanh(self.lin(x))
        return torch.tanh(self.lin(h)) if self.twice else h  # the same weight used twice


def chain(n: int, twice_at: int | None = None, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(Block(i == twice_at) for i in range(n)))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


class Recorder(torch.nn.Module):
    """Wraps a stage module and keeps a copy of every input it is called with."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return self.inner(x)


def uninitialised_forward(rank: int, world: int) -> dict:
    """Two hand-built stages without ``input_args``, 1F1B: what stage 1's module is called with."""
    from torch.distributed import pipelining as tdp

    model = chain(2)
    x, y = data()
    sub = Recorder(model[rank])
    stage = tdp.PipelineStage(sub, rank, world, torch.device("cpu"))
    sched = tdp.Schedule1F1B(stage, N_MB, loss_fn=F.mse_loss)
    with common.quiet():
        sched.step(x) if rank == 0 else sched.step(target=y)
    first, real = sub.seen[0], sub.seen[1:]  # the extra inference call, then the microbatches
    return {"calls": len(sub.seen), "first_is_meta": first.is_meta,
            "first_equals_a_real_input": any(torch.equal(first, t) for t in real),
            "first_equals_model_data": rank == 0 and any(torch.equal(first, c) for c in x.chunk(N_MB))}


def zero_bubble_twice(rank: int, world: int) -> dict:
    """ZBVZeroBubble over 4 hand-built stages on 2 ranks; stage 0 uses its weight twice.

    Returns this rank's stages' gradients and the unsplit model's (mean loss over microbatches).
    """
    from torch.distributed import pipelining as tdp

    model = chain(4, twice_at=0)
    ref = copy.deepcopy(model)
    x, y = data()
    losses = [F.mse_loss(ref(xc), yc) for xc, yc in zip(x.chunk(N_MB), y.chunk(N_MB))]
    (sum(losses) / N_MB).backward()
    mine = [rank, 2 * world - 1 - rank]  # V placement: rank 0 holds stages 0 and 3
    stages = [tdp.PipelineStage(model[s], s, 2 * world, torch.device("cpu")) for s in mine]
    sched = tdp.ScheduleZBVZeroBubble(stages, N_MB, loss_fn=F.mse_loss)
    with common.quiet():
        sched.step(x, target=y) if rank == 0 else sched.step()
    return {s: {n: (p.grad.clone(), dict(ref[s].named_parameters())[n].grad.clone())
                for n, p in model[s].named_parameters()} for s in mine}


def traffic_peer(rank: int, world: int, case_name: str, schedule: str, n_mb: int, reps: int) -> dict:
    """benchmarks.traffic's peer body for one case (a RankFailure carries the peer's error)."""
    from benchmarks import traffic

    return traffic._body(rank, world, traffic.Case(case_name, schedule, world, n_mb), "peer", reps)


def zero_bubble_twice_traced(rank: int, world: int, schedule: str) -> dict:
    """As :func:`zero_bubble_twice`, the stages cut by the peer's ``pipeline`` (same modules)."""
    from torch.distributed import pipelining as tdp

    model = chain(4, twice_at=0)
    ref = copy.deepcopy(model)
    x, y = data()
    losses = [F.mse_loss(ref(xc), yc) for xc, yc in zip(x.chunk(N_MB), y.chunk(N_MB))]
    (sum(losses) / N_MB).backward()
    with common.quiet():
        pipe = tdp.pipeline(model, mb_args=(x.chunk(N_MB)[0],),
                            split_spec={f"{i}": tdp.SplitPoint.BEGINNING for i in (1, 2, 3)})
    mine = [rank, 2 * world - 1 - rank] if schedule == "ZBVZeroBubble" else [rank, rank + world]
    stages = [tdp.PipelineStage(pipe.get_stage_module(s), s, 2 * world, torch.device("cpu")) for s in mine]
    sched = getattr(tdp, "Schedule" + schedule)(stages, N_MB, loss_fn=F.mse_loss)
    with common.quiet():
        sched.step(*((x,) if 0 in mine else ()), **({"target": y} if 2 * world - 1 in mine else {}))
    out = {}
    for s in mine:
        for n, p in pipe.get_stage_module(s).named_parameters():
            out[(s, n)] = (p.grad.clone(), dict(ref.named_parameters())[n].grad.clone())
    return out


class UsesYFirst(torch.nn.Module):
    """forward(x, y): the first stage reads y before x (both (mb, D), so a swap cannot fail on shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        h = self.a(y) * 2 + x
        pipe_split()
        return self.b(h)


def arg_order(rank: int, world: int) -> dict | None:
    """The peer's GPipe forward of :class:`UsesYFirst` over 2 ranks, the documented way."""
    from torch.distributed import pipelining as tdp

    torch.manual_seed(0)
    model = UsesYFirst()
    x, y = data()
    with common.quiet():
        pipe = tdp.pipeline(model, mb_args=(x.chunk(N_MB)[0], y.chunk(N_MB)[0]))
        sched = tdp.ScheduleGPipe(pipe.build_stage(rank, torch.device("cpu")), N_MB)
        out = sched.step(x, y) if rank == 0 else sched.step()
    if rank == 0:
        return None
    with torch.no_grad():
        return {"out": out.detach(), "model": model(x, y), "swapped": model(y, x)}


class SeqModel(torch.nn.Module):
    """(mb, T) token ids -> (mb, T, D): what crosses the cut has the sequence length in it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, D)
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.emb(x))))


def other_length(rank: int, world: int) -> dict:
    """The peer's traced pipe built on (2, 16) microbatches, then a step of length 8 (GPipe, 2 ranks)."""
    from torch.distributed import pipelining as tdp

    torch.manual_seed(0)
    model = SeqModel()
    pipe = tdp.pipeline(model, (torch.zeros(2, 16, dtype=torch.long),), split_spec={"b": tdp.SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = tdp.ScheduleGPipe(stage, N_MB, loss_fn=lambda out, t: out.pow(2).mean())
    x = torch.randint(0, 16, (8, 8))
    with common.quiet():
        out = sched.step(x) if rank == 0 else sched.step(target=torch.zeros(8, 8, D))
    return {"out_shape": None if out is None else tuple(out.shape)}
