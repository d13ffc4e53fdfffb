"""What one split of a model costs per stage: the planner's measured inputs.

Sits between the split layer (trace, per-op profile, balancer) and the planner's
search (:mod:`.search`). The model is traced once and profiled op by op once
(:func:`pippy_split.split.profile.op_profiles`: forward, input-grad and weight-grad
time, the storages autograd saves); a split into ``S`` stages then costs nothing
more to price: each stage sums its ops.

Scaling to another microbatch size: every op's time is a fixed dispatch overhead
(measured once on a one-element op the same way) plus a part proportional to the
microbatch; bytes are proportional. Communication is ``latency + bytes / bandwidth``
per message (:class:`CommModel`).
"""

from __future__ import annotations

import bisect
import operator
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..split.calls import all_module_paths
from ..split.cost import value_bytes
from ..split.partition import Cut, plan_stages
from ..split.partition import Partition as PartitionPlan
from ..split.pipe import Pipe
from ..split.profile import DEFAULT_PASSES, OpProfile, op_profiles
from ..split.stage_graph import build_stages
from ..split.trace import Traced, trace_model
from ..stage.groups import GroupArg

__all__ = ["CommModel", "StageCosts", "SplitCosts", "parse_bytes", "price_split", "resize_batch", "cut_fqns"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | float | int) -> float:
    """``"2GB"`` -> 2e9, ``"512MiB"`` -> 536870912.0, a number stays as it is.

    Example:
        >>> parse_bytes("2GB"), parse_bytes("1.5 MiB"), parse_bytes(1000)
        (2000000000.0, 1572864.0, 1000.0)
    """
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {value!r}: write a number of bytes or e.g. '2GB', '512MiB', "
                         f"'80GiB' (units {', '.join(u for u in _UNITS if u)}, case-insensitive)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class CommModel:
    """Time of one message between ranks: ``latency + bytes / bandwidth``.

    Attributes:
        bandwidth: bytes per second.
        latency: seconds per message.
        source: where the figures come from ("default", "measured on ...", "given").
    """

    bandwidth: float = 2e9
    latency: float = 50e-6
    source: str = "default"

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"CommModel needs bandwidth > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    @classmethod
    def measure(cls, group: GroupArg = None, nbytes: int = 1 << 22, repeats: int = 7) -> "CommModel":
        """Ping-pong between ranks 0 and 1 of ``group`` (a process group or a 1-D DeviceMesh;
        every rank of it must call this):
        a 4-byte message gives the latency, an ``nbytes`` one (4 MiB) the bandwidth; each
        the least one-way time over ``repeats``.

        Example:
            >>> comm = CommModel.measure()  # inside an initialised process group  # doctest: +SKIP
        """
        import torch.distributed as dist

        from ..stage.groups import process_group

        group = process_group(group, "CommModel.measure")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        peer = 1 - rank if rank < 2 else None

        def one_way(n: int) -> float:
            buf = torch.zeros(max(n // 4, 1), dtype=torch.float32)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier(group)
                t0 = time.perf_counter()
                if peer is not None:
                    g_peer = dist.get_global_rank(group, peer) if group is not None else peer
                    if rank == 0:
                        dist.send(buf, g_peer, group=group)
                        dist.recv(buf, g_peer, group=group)
                    else:
                        dist.recv(buf, g_peer, group=group)
                        dist.send(buf, g_peer, group=group)
                best = min(best, (time.perf_counter() - t0) / 2)
            out = torch.tensor([best], dtype=torch.float64)
            dist.broadcast(out, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            return float(out)

        if world < 2:
            return cls(source="default (a group of one rank)")
        small, big = one_way(4), one_way(nbytes)
        # On a busy machine the small message can take nearly as long as the big one; then
        # the difference says nothing and the big message alone bounds the bandwidth.
        bandwidth = nbytes / (big - small) if big > 1.5 * small else nbytes / big
        return cls(bandwidth=bandwidth, latency=small, source=f"measured on the current group ({dist.get_backend(group)})")


@dataclass(frozen=True)
class StageCosts:
    """One stage on the example microbatch (seconds and bytes).

    Attributes:
        forward / input_grad / weight_grad: summed op times, fixed overhead included.
        overhead: the part of each of those three that does not grow with the microbatch
            (``(forward, input_grad, weight_grad)``).
        held_bytes: what one microbatch keeps from its forward to its backward (the
            union of the storages autograd saves), without checkpointing.
        boundary_bytes: what it keeps under full checkpointing (its inputs and outputs).
        param_bytes: its parameters.
        wgrad_bytes: what a split backward keeps from I until W (the output gradients of
            the ops that read parameters).
    """

    forward: float
    input_grad: float
    weight_grad: float
    overhead: tuple[float, float, float]
    held_bytes: float
    boundary_bytes: float
    param_bytes: float
    wgrad_bytes: float = 0.0

    def times(self, scale: float) -> tuple[float, float, float]:
        """``(F, I, W)`` seconds at ``scale`` x the example microbatch."""
        out = []
        for total, fixed in zip((self.forward, self.input_grad, self.weight_grad), self.overhead):
            fixed = min(fixed, total)
            out.append(fixed + (total - fixed) * scale)
        return out[0], out[1], out[2]


@dataclass
class SplitCosts:
    """A split of the model into stages, with each stage's costs and what crosses each cut."""

    pipe: Pipe
    """The split, traced on the example microbatch."""
    metric: str
    stages: list[StageCosts]
    link_bytes: dict[tuple[int, int], float]
    """``(src, dst) -> bytes`` one microbatch sends from ``src`` to ``dst`` (example size)."""
    positions: list[int] = field(default_factory=list)
    """The cuts, as indices into the traced graph's call nodes."""
    model: torch.nn.Module | None = field(default=None, repr=False)
    example: tuple[tuple, dict] = field(default=((), {}), repr=False)
    batch: int = 1
    """Microbatch size of the example."""
    measured: Any = field(default=None, repr=False)
    """The stages' actions measured by running them (:class:`~.measure.SplitMeasure`), or None."""
    _pipes: dict[int, Pipe] = field(default_factory=dict, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def shares(self) -> list[float]:
        """Each stage's share of the forward + backward time."""
        tot = [s.forward + s.input_grad + s.weight_grad for s in self.stages]
        return [t / sum(tot) if sum(tot) else 0.0 for t in tot]

    def pipe_for(self, batch: int) -> Pipe:
        """The same cuts, traced on a microbatch of ``batch`` samples (a trace has static
        shapes, so a schedule of another microbatch size needs its own)."""
        if batch == self.batch or self.model is None:
            return self.pipe
        if batch not in self._pipes:
            args, kwargs = (resize_batch(self.example[0], self.batch, batch),
                            {k: v for k, v in zip(self.example[1], resize_batch(tuple(self.example[1].values()),
                                                                           self.batch, batch))})
            traced = trace_model(self.model, args, kwargs or None)
            ops = [n for n in traced.graph.nodes if n.op == "call_function"]
            if len(ops) != len(self.pipe_ops):
                raise ValueError(f"the model traces to {len(ops)} ops on a microbatch of {batch} but to "
                                 f"{len(self.pipe_ops)} on {self.batch}; plan with an example of {batch} samples")
            self._pipes[batch] = _build_pipe(traced, _plan_at(ops, self.positions), self.model)
        return self._pipes[batch]

    @property
    def pipe_ops(self) -> list:
        return [n for n in self.pipe._traced.graph.nodes if n.op == "call_function"]

    @property
    def cut_fqns(self) -> list[str | None]:
        """Per cut, the module whose beginning it is (what ``ps.pipeline(model, [fqn, ...])``
        cuts before), or None where the cut falls inside a module's code (see
        :func:`cut_fqns`)."""
        if "_cut_fqns" not in self.__dict__:
            self.__dict__["_cut_fqns"] = cut_fqns(self.pipe_ops, self.positions, self.model)
        return self.__dict__["_cut_fqns"]

    @property
    def cut_label(self) -> str:
        """The cuts for a reader: ``"blocks.1, blocks.2, blocks.3"``; a cut no module begins
        at reads ``"inside blocks.1.mlp"`` (the innermost module around it)."""
        ops = self.pipe_ops
        names = [fqn if fqn is not None else f"inside {_innermost(ops[p]) or 'the model'}"
                 for fqn, p in zip(self.cut_fqns, self.positions)]
        return ", ".join(names) if names else "none (1 stage)"


def cut_fqns(ops: Sequence[torch.fx.Node], positions: Sequence[int],
             model: torch.nn.Module | None) -> list[str | None]:
    """Per cut position (an index into ``ops``, a traced graph's call nodes), the module
    that begins there, as :func:`~pippy_split.pipeline` reads a split FQN (its first op is
    ``ops[position]``), or None where no module begins there. Among the modules beginning
    at a cut, the outermost that ends before the next cut: the first module of the stage
    (``blocks.1``, not ``blocks.1.ln_1``; not ``blocks`` for a cut before ``blocks.0``
    when later cuts fall inside ``blocks``).

    Example:
        >>> from pippy_split import zoo
        >>> model = zoo.get("mlp_stack", d=8).model  # 8 residual layers: linear, tanh, add each
        >>> ops = [n for n in trace_model(model, (torch.randn(2, 8),)).graph.nodes if n.op == "call_function"]
        >>> cut_fqns(ops, [3, 7], model)  # before layers.1's linear; before layers.2's tanh, where no module begins
        ['layers.1', None]
    """
    known = {name for name, _ in model.named_modules() if name} if model is not None else None
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for path in all_module_paths(op):
            first.setdefault(path, i)
            last[path] = i
    ends = list(positions[1:]) + [len(ops)]
    out: list[str | None] = []
    for p, end in zip(positions, ends):
        starting = [path for path, i in first.items() if i == p and (known is None or path in known)]
        whole = [path for path in starting if last[path] < end]
        out.append(min(whole or starting, key=lambda f: (f.count("."), f)) if starting else None)
    return out


def _innermost(op: torch.fx.Node) -> str | None:
    paths = all_module_paths(op)
    return paths[-1] if paths else None


def resize_batch(values: tuple, old: int, new: int) -> tuple:
    """Tensors whose dim 0 is ``old`` cut or tiled to ``new`` (the planner's examples only
    shape a trace or a measurement; their values do not matter)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == old:
            reps = -(-new // old)
            v = torch.cat([v] * reps)[:new] if reps > 1 else v[:new]
        out.append(v)
    return tuple(out)


def _plan_at(ops: list, positions: list[int]) -> PartitionPlan:
    """A partition of ``ops`` with cuts before ``ops[p]`` for each position (getitems stay
    with their tuple, as :func:`~pippy_split.split.partition.plan_stages` keeps them)."""
    stage_of = {op: bisect.bisect_right(positions, i) for i, op in enumerate(ops)}
    for op in ops:
        if op.target is operator.getitem and isinstance(op.args[0], torch.fx.Node) and op.args[0] in stage_of:
            stage_of[op] = stage_of[op.args[0]]
    return PartitionPlan(ops=ops, cuts=[Cut(p, f"planned cut {k + 1}") for k, p in enumerate(positions)],
                         stage_of=stage_of)


def _build_pipe(traced: Traced, plan: PartitionPlan, model: torch.nn.Module) -> Pipe:
    built = build_stages(traced, plan, model)
    # The model as pipeline() gives it: a meta stage's tensors are initialised from it (Pipe.fill_stage_module).
    return Pipe(traced, built.stages, built.edges, built.symbols, built.output_leaves, built.shared_parameters,
                type(model).__name__, model=model, balance=plan.balance)


def price_split(traced: Traced, model: torch.nn.Module, flat_inputs: Sequence[Any], num_stages: int,
                metric: str = "time", overhead: tuple[float, float, float] = (0.0, 0.0, 0.0),
                example: tuple[tuple, dict] = ((), {}), batch: int = 1, passes: int = 3) -> SplitCosts:
    """Cut ``traced`` into ``num_stages`` stages balanced by ``metric`` and price each stage.

    Example:
        >>> from pippy_split import zoo
        >>> model = zoo.get("mlp_stack", d=8).model; x = torch.randn(2, 8)  # 8 residual layers
        >>> traced = trace_model(model, (x,))
        >>> costs = price_split(traced, model, traced.flatten_inputs((x,), {}), 4, metric="flops")
        >>> costs.cut_label, costs.link_bytes[0, 1], round(sum(costs.shares), 6)  # shares: of the measured time
        ('layers.2, layers.4, layers.6', 64.0, 1.0)
    """
    profs = op_profiles(traced, model, flat_inputs, passes)
    # The balancer (balance="time") reads the default profile: let it cut by the figures
    # priced here (in a process group, rank 0's), not by a fresh, differently noisy one.
    traced.__dict__.setdefault("_op_profiles", {})[DEFAULT_PASSES] = profs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an uneven split is priced as it is
        plan = plan_stages(traced.graph, num_stages, model, balance=metric, traced=traced, flat_inputs=flat_inputs)
    pipe = _build_pipe(traced, plan, model)
    stage_ops: list[list[tuple[torch.fx.Node, OpProfile]]] = [[] for _ in range(num_stages)]
    for op, prof in zip(plan.ops, profs):
        stage_ops[plan.stage_of[op]].append((op, prof))
    links = _link_bytes(plan)
    stages = []
    for s, items in enumerate(stage_ops):
        saved: dict[int, int] = {}
        for _, prof in items:
            saved.update(prof.saved)
        n_real = sum(1 for op, _ in items if op.target is not operator.getitem)
        boundary = sum(b for (src, dst), b in links.items() if s in (src, dst))
        fixed = tuple(n_real * c for c in overhead)
        stages.append(StageCosts(
            forward=sum(p.forward for _, p in items), input_grad=sum(p.input_grad for _, p in items),
            weight_grad=sum(p.weight_grad for _, p in items), overhead=(fixed[0], fixed[1], fixed[2]),
            held_bytes=float(sum(saved.values())) + boundary, boundary_bytes=float(boundary),
            param_bytes=float(pipe.stages[s].param_bytes),
            wgrad_bytes=float(sum(p.output_bytes for _, p in items if p.reads_params))))
    return SplitCosts(pipe, metric, stages, links, [c.index for c in plan.cuts], model, example, batch)


def _link_bytes(plan: PartitionPlan) -> dict[tuple[int, int], float]:
    """Bytes of the values each stage's ops send to each later stage (one microbatch)."""
    out: dict[tuple[int, int], float] = {}
    for op in plan.ops:
        src = plan.stage_of[op]
        dsts = {plan.stage_of[u] for u in op.users if u in plan.stage_of} - {src}
        for dst in dsts:
            out[(src, dst)] = out.get((src, dst), 0.0) + float(value_bytes(op.meta.get("val")))
    return out

