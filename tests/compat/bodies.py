"""Models, references and rank bodies of the compat tests (top-level so they pickle).

The bodies are written the way torch.distributed.pipelining code is: one import
switched to ``pippy_split.compat``, rank-specific ``step`` calls (rank 0 passes
the inputs, the last rank the target and ``losses``), ``stage.submod`` for grads.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pippy_split import compat
from pippy_split.compat import schedules as S

D = 8  # hidden size
BATCH = 8
N_MB = 4


class Block(torch.nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class MLP(torch.nn.Module):
    """``n`` blocks; a hand-built stage is one block, FQNs ``layers.<i>.lin.weight``."""

    def __init__(self, n: int = 4, d: int = D) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class WithKwargs(torch.nn.Module):
    """A keyword input read after the cut: it crosses to stage 1 from the rank given the data."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.a(x))
        compat.pipe_split()
        return self.b(h) + y


def make(n_layers: int = 4, seed: int = 0):
    """(model, x, target) identical on every rank."""
    torch.manual_seed(seed)
    model = MLP(n_layers)
    x = torch.randn(BATCH, D)
    target = torch.randn(BATCH, D)
    return model, x, target


def reference(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, n_mb: int = N_MB, loss_fn=F.mse_loss,
              steps: int = 1):
    """Per-microbatch losses, full output and grads (FQN) of the unsplit model: mean over microbatches,
    as a schedule with scale_grads=True computes them; ``steps`` steps accumulate."""
    model = copy.deepcopy(model)
    losses = []
    for _ in range(steps):
        losses = []
        for xm, tm in zip(x.chunk(n_mb), target.chunk(n_mb)):
            loss = loss_fn(model(xm), tm)
            (loss / n_mb).backward()
            losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        out = model(x)
    return losses, out, grads


def grads_of(modules: list[torch.nn.Module], prefix: list[str] | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for i, mod in enumerate(modules):
        for n, p in mod.named_parameters():
            if p.grad is not None:
                out[(prefix[i] + "." if prefix else "") + n] = p.grad.clone()
    return out


# ---- traced pipes, one stage per rank ------------------------------------------------
def traced_body(rank: int, world: int, schedule_name: str) -> dict:
    """compat.pipeline with torch's own SplitPoint; the peer's rank-specific step calls."""
    from torch.distributed.pipelining import SplitPoint as TorchSplitPoint

    model, x, target = make()
    pipe = compat.pipeline(model, (x.chunk(N_MB)[0],), split_spec={"layers.2": TorchSplitPoint.BEGINNING})
    stage = compat.build_stage(pipe.get_stage_module(rank), rank, pipe.info(), torch.device("cpu"))
    cls = S.get_schedule_class(schedule_name)
    sched = cls(stage, N_MB, loss_fn=F.mse_loss) if issubclass(cls, S.PipelineScheduleSingle) else \
        cls([stage], N_MB, loss_fn=F.mse_loss)
    losses = ["stale"]
    out = None
    for _ in range(2):  # a reused list holds this step's losses only
        stage.submod.zero_grad()
        out = sched.step(x) if rank == 0 else sched.step(target=target, losses=losses)
    grads = grads_of([stage.submod])
    no_out = sched.step(x) if rank == 0 else sched.step(target=target, return_outputs=False)
    eval_losses = [1.0]
    evaluated = sched.eval(x) if rank == 0 else sched.eval(target=target, losses=eval_losses)
    return {"grads": grads, "losses": losses if rank else None, "out": out, "no_out": no_out, "eval": evaluated,
            "eval_losses": eval_losses if rank else None, "type": type(sched).__name__}


def kwargs_body(rank: int, world: int, schedule_name: str) -> dict:
    """pipeline(module, mb_args, mb_kwargs): y goes to rank 0 only, stage 1 reads it."""
    torch.manual_seed(0)
    model = WithKwargs()
    x, y, target = torch.randn(BATCH, D), torch.randn(BATCH, D), torch.randn(BATCH, D)
    pipe = compat.pipeline(model, (x.chunk(N_MB)[0],), {"y": y.chunk(N_MB)[0]})
    sched = S.get_schedule_class(schedule_name)(pipe.build_stage(rank, torch.device("cpu")), N_MB,
                                                 loss_fn=torch.nn.MSELoss(reduction="sum"))
    losses = []
    out = sched.step(x, y=y) if rank == 0 else sched.step(target=target, losses=losses)
    with torch.no_grad():
        ref_out = model(x, y=y)
    ref_loss = torch.nn.MSELoss(reduction="sum")(ref_out, target)
    return {"out": out, "ref_out": ref_out, "loss": sum(losses) if rank else None, "ref_loss": ref_loss}


# ---- hand-built stages, two per rank ---------------------------------------------------
def stage_indices(schedule_name: str, rank: int, world: int) -> list[int]:
    v = schedule_name in ("ZBVZeroBubble", "DualPipeV")
    return [rank, 2 * world - 1 - rank] if v else [rank, rank + world]


def manual_body(rank: int, world: int, schedule_name: str, n_mb: int) -> dict:
    """PipelineStage(submodule, i, n, device, input_args=...) with a dw_builder that counts its runs."""
    model, x, target = make()
    idx = stage_indices(schedule_name, rank, world)
    runs = {i: 0 for i in idx}

    def builder(i):
        def build():
            def run():
                runs[i] += 1
            return run
        return build

    stages = [compat.PipelineStage(model.layers[i], i, 2 * world, torch.device("cpu"),
                                   input_args=(x.chunk(n_mb)[0],), dw_builder=builder(i)) for i in idx]
    sched = S.get_schedule_class(schedule_name)(stages, n_mb, loss_fn=F.mse_loss)
    holds_first, holds_last = 0 in idx, 2 * world - 1 in idx
    losses = []
    kwargs = {"target": target, "losses": losses} if holds_last else {}
    out = sched.step(x, **kwargs) if holds_first else sched.step(**kwargs)
    return {"grads": grads_of([st.submod for st in stages], [f"layers.{i}" for i in idx]), "runs": runs,
            "losses": losses if holds_last else None, "out": out if holds_last else None,
            "order": {r: [str(a) for a in acts if a is not None] for r, acts in sched.pipeline_order.items()},
            "placement": sched.stage_index_to_group_rank}


def forward_only_body(rank: int, world: int) -> dict:
    """No loss_fn: step() is forward only on every rank (no raise, no hang); eval(target=, losses=)."""
    model, x, target = make()
    pipe = compat.pipeline(model, (x.chunk(N_MB)[0],), split_spec={"layers.2": compat.SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    out = S.Schedule1F1B(stage, N_MB).step(x) if rank == 0 else S.Schedule1F1B(stage, N_MB).step()
    no_grads = all(p.grad is None for p in stage.submod.parameters())
    losses_error = None
    sched = S.ScheduleGPipe(stage, N_MB)
    try:
        sched.step(x) if rank == 0 else sched.step(losses=[])
    except RuntimeError as e:
        losses_error = str(e)
    with_loss = S.ScheduleGPipe(stage, N_MB, loss_fn=lambda o, t, scale=1.0: F.mse_loss(o, t) * scale)
    eval_losses = ["stale"]
    evaluated = with_loss.eval(x) if rank == 0 else with_loss.eval(target=target, losses=eval_losses)
    kw_losses = []
    with_loss.step(x) if rank == 0 else with_loss.step(target=target, losses=kw_losses, loss_kwargs={"scale": 2.0})
    dist.barrier()
    return {"out": out, "no_grads": no_grads, "losses_error": losses_error, "eval": evaluated,
            "eval_losses": eval_losses if rank else None, "kw_losses": kw_losses if rank else None}


# ---- side by side with torch.distributed.pipelining ------------------------------------
def versus_peer_body(rank: int, world: int) -> dict:
    """The same traced GPipe step and the same hand-built Interleaved1F1B step through the
    peer and through compat, in one process group: outputs, losses and grads."""
    import torch.distributed.pipelining as peer
    import torch.distributed.pipelining.schedules as peer_schedules

    results = {}
    for lib, sched_mod in (("peer", peer_schedules), ("ours", S)):
        api = peer if lib == "peer" else compat
        model, x, target = make()
        pipe = api.pipeline(model, (x.chunk(N_MB)[0],), split_spec={"layers.2": api.SplitPoint.BEGINNING})
        stage = pipe.build_stage(rank, torch.device("cpu"))
        losses = []
        sched = sched_mod.ScheduleGPipe(stage, N_MB, loss_fn=F.mse_loss)
        out = sched.step(x) if rank == 0 else sched.step(target=target, losses=losses)
        traced = {"out": out, "losses": [v.detach() for v in losses], "grads": grads_of([stage.submod])}

        model, x, target = make()
        idx = [rank, rank + world]
        stages = [api.PipelineStage(model.layers[i], i, 2 * world, torch.device("cpu")) for i in idx]
        sched = sched_mod.ScheduleInterleaved1F1B(stages, N_MB, loss_fn=F.mse_loss)
        losses = []
        out = sched.step(x) if rank == 0 else sched.step(target=target, losses=losses)
        manual = {"out": out, "losses": [v.detach() for v in losses],
                  "grads": grads_of([st.submod for st in stages], [f"layers.{i}" for i in idx])}
        results[lib] = {"traced": traced, "manual": manual}
        dist.barrier()
    return results


# ---- exception types, next to the peer's ------------------------------------------------
def error_types_body(rank: int, world: int) -> dict:
    """Misuses that fail at construction, through the peer and through compat (one rank):
    ``{case: (peer exception type, ours)}``."""
    import torch.distributed.pipelining as peer
    import torch.distributed.pipelining.schedules as peer_schedules

    def kind(fn) -> str:
        try:
            fn()
        except Exception as e:  # the type is what is compared
            return type(e).__name__
        return "no error"

    out = {}
    for lib, sched_mod in (("peer", peer_schedules), ("ours", S)):
        api = peer if lib == "peer" else compat
        model, x, _ = make(3)
        pipe3 = api.pipeline(model, (x[:2],), split_spec={"layers.1": api.SplitPoint.BEGINNING,
                                                          "layers.2": api.SplitPoint.BEGINNING})
        stages3 = [pipe3.build_stage(i, torch.device("cpu")) for i in range(3)]
        loss = F.mse_loss
        cases = {
            "ZBV, 1 stage per rank": lambda: sched_mod.ScheduleZBVZeroBubble(stages3[:1], 4, loss_fn=loss),
            "ZBV, 3 stages per rank": lambda: sched_mod.ScheduleZBVZeroBubble(stages3, 4, loss_fn=loss),
            "ZBV, a bare stage": lambda: sched_mod.ScheduleZBVZeroBubble(stages3[0], 4, loss_fn=loss),
            "DualPipeV, 1 stage per rank": lambda: sched_mod.ScheduleDualPipeV(stages3[:1], 4, loss_fn=loss),
            "PipelineScheduleSingle itself": lambda: sched_mod.PipelineScheduleSingle(stages3[0], 4, loss),
            "unknown schedule name": lambda: sched_mod.get_schedule_class("NoSuchSchedule"),
            "get_stage_module out of range": lambda: pipe3.get_stage_module(7),
            "build_stage out of range": lambda: pipe3.build_stage(7, torch.device("cpu")),
            "PipelineStage index out of range": lambda: api.PipelineStage(torch.nn.Linear(2, 2), 3, 2,
                                                                          torch.device("cpu")),
        }
        for name, fn in cases.items():
            out.setdefault(name, []).append(kind(fn))
    return {k: tuple(v) for k, v in out.items()}
