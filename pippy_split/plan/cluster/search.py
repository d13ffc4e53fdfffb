"""``ps.plan_cluster``: which (pp, dp, tp), schedule, virtual stages, microbatches and
activation checkpointing for a model on a cluster, on paper.

Sits on :mod:`.costs` (the cost model, stated there and in :mod:`.kernels`,
:mod:`.block` and :mod:`.memory`) and the schedule layer: every candidate's order is the one
its schedule would run (``get_order_spec(name).compute_order``), simulated once with its
per-stage costs; the simulator's per-rank peak of held bytes gives the activation memory,
and :func:`.memory.reserved_bytes` what the caching allocator reserves around it.

Example:
    >>> from pippy_split.plan.cluster import Cluster, ModelShape
    >>> tiny = ModelShape(layers=8, hidden=1024, intermediate=4096, heads=8, kv_heads=8, vocab=32000)
    >>> plan = plan_cluster(tiny, Cluster.preset("h100x16"), global_batch_tokens=2**20, seq_len=4096)
    >>> plan.best.layout.pp * plan.best.layout.dp * plan.best.layout.tp
    16
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ...schedule import Simulation, simulate
from ...schedule.orders import get_order_spec
from .costs import LayoutCosts, data_parallel_exposed_s, layout_costs, optimizer_s
from .hardware import Cluster, GiB
from .layout import ClusterLayout
from .memory import (
    BF16,
    block_activation_bytes,
    loss_peak_bytes,
    reserved_bytes,
    static_bytes,
    timeline_peak,
    unsharded_without_pp,
)
from .runtime import Runtime
from .shape import ModelShape, model_shape

__all__ = ["plan_cluster", "price_layout", "ClusterCandidate", "ClusterPlan", "SCHEDULES"]

SCHEDULES: dict[str, tuple[int, ...]] = {"GPipe": (1,), "1F1B": (1,), "Interleaved1F1B": (2, 4),
                                         "ZBVZeroBubble": (2,), "DualPipeV": (2,)}
"""Schedules searched and their stages per rank."""
RESERVE = "allocator reserve (cached, not live)"


@dataclass
class ClusterCandidate:
    """One priced layout: its step, throughput and memory per GPU."""

    layout: ClusterLayout
    schedule: str
    step_s: float
    tokens_per_s_per_gpu: float
    memory: dict[str, float]
    """Bytes the fullest GPU reserves, by what they are: live tensors, and the caching
    allocator's reserve beyond them (``torch.cuda.max_memory_reserved``'s view)."""
    bubble: float
    fits: bool
    why: str
    cluster: Cluster = field(repr=False)
    seq_len: int = 0
    model_ref: str = "hf:DIR"

    @property
    def memory_bytes(self) -> float:
        """Bytes reserved on the fullest GPU (``max_memory_reserved``)."""
        return sum(self.memory.values())

    @property
    def live_bytes(self) -> float:
        """Bytes of live tensors at the fullest GPU's peak (``max_memory_allocated``)."""
        return self.memory_bytes - self.memory.get(RESERVE, 0.0)

    def launch(self, model: str | None = None) -> str:
        """The ``torchrun`` + ``pippy_split.train`` command line for this layout (run on every node);
        a layout ``pippy_split.train`` cannot run (CP, DP without FSDP, selective AC) is refused.

        Example: ``torchrun --nnodes 64 --nproc-per-node 8 ... -m pippy_split.train --model hf:DIR --dp 8 ...``
        """
        lay, c = self.layout, self.cluster
        cannot = [what for what, bad in ((f"context parallelism cp={lay.cp}", lay.cp > 1),
                                         ("data parallelism without FSDP", not lay.fsdp),
                                         (f"activation checkpointing {lay.ac!r}", lay.ac_mode not in ("none", "full")))
                  if bad]
        if cannot:
            raise ValueError(f"pippy_split.train cannot run this layout ({', '.join(cannot)}): it runs FSDP2 data "
                             "parallelism, no context parallelism, and full activation checkpointing or none; "
                             "this layout is priced for the runtime that runs it")
        rows = lay.m * lay.mb
        parts = [f"torchrun --nnodes {c.nodes} --nproc-per-node {min(c.gpus, c.gpus_per_node)}",
                 "--rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500",
                 f"-m pippy_split.train --model {model or self.model_ref}",
                 f"--dp {lay.dp} --tp {lay.tp} --schedule {self.schedule} --microbatches {lay.m}",
                 f"--batch-size {rows} --seq-len {self.seq_len}"]
        if lay.ac == "full":
            parts.append("--activation-checkpoint full")
        return " ".join(parts)

    def row(self) -> list[str]:
        lay = self.layout
        mesh = f"pp{lay.pp} dp{lay.dp}" + (f" cp{lay.cp}" if lay.cp > 1 else "") + f" tp{lay.tp}"
        return [mesh, self.schedule, str(lay.v), f"{lay.m}x{lay.mb}",
                "off" if lay.ac == "none" else str(lay.ac), f"{self.tokens_per_s_per_gpu:,.0f}",
                f"{self.memory_bytes / GiB:.1f} GiB", f"{self.bubble:.0%}", self.why]


HEADER = ["mesh", "schedule", "v", "m x mb", "AC", "tokens/s/GPU", "memory/GPU", "bubble", "why"]


@dataclass
class ClusterPlan:
    """Ranked candidates, fitting ones first, fastest first; ``best`` the top one."""

    candidates: list[ClusterCandidate]
    cluster: Cluster

    @property
    def best(self) -> ClusterCandidate:
        return self.candidates[0]

    def table(self, top: int = 10) -> str:
        rows = [HEADER] + [c.row() for c in self.candidates[:top]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in c.row()) + "</tr>"
                       for c in self.candidates[:20])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def price_layout(model: ModelShape, cluster: Cluster, lay: ClusterLayout, schedule: str, seq_len: int,
                 optimizer: str = "adamw", dtype_bytes: int = BF16, runtime: Runtime | None = None) -> ClusterCandidate:
    """Price one layout: its schedule's real order simulated once with per-stage costs
    (``dtype_bytes``: the training dtype's element size, as :func:`.costs.layout_costs`;
    ``runtime``: how the training code runs, :class:`.runtime.Runtime`, default pippy_split's).

    Example:
        >>> shape = ModelShape(layers=4, hidden=512, intermediate=2048, heads=8, kv_heads=8, vocab=1000)
        >>> lay = ClusterLayout(pp=2, dp=4, tp=1, v=1, m=4, mb=1, ac="full")
        >>> price_layout(shape, Cluster.preset("h100x8"), lay, "1F1B", 2048).fits
        True
    """
    if lay.gpus != cluster.gpus:
        raise ValueError(f"layout pp{lay.pp} x dp{lay.dp} x cp{lay.cp} x tp{lay.tp} = {lay.gpus} GPUs, "
                         f"but the cluster has {cluster.gpus}")
    if seq_len % lay.cp:
        raise ValueError(f"seq_len {seq_len} does not split into cp={lay.cp} equal shards")
    spec = get_order_spec(schedule)
    order = spec.compute_order(lay.pp, lay.m, lay.v)
    c = layout_costs(model, cluster, lay, seq_len, dtype_bytes, runtime)
    S = lay.stages
    costs: dict[Any, float] = {}
    o = cluster.action_overhead  # each action's host work, besides its ops
    for s in range(S):
        f, b, r = c.forward[s], c.backward[s], c.recompute[s]
        costs.update({(s, "F"): f + o, (s, "I"): b / 2 + r + o, (s, "W"): b / 2 + o, (s, "B"): b + r + o})
    sim = simulate(order, costs, comm_latency=c.p2p_s, activation_bytes=c.held, workspace_bytes=c.workspace)
    where = spec.stage_placement(S, lay.pp)
    worst: dict[str, float] = {}
    exposed = 0.0
    for rank in range(lay.pp):
        mine = [s for s in range(S) if where[s] == rank]
        layers = sum(c.layers[s] for s in mine)
        compute = lay.m * sum(c.forward[s] + c.backward[s] + c.recompute[s] for s in mine)
        one_bwd = sum(c.backward[s] for s in mine)
        mem = static_bytes(model, lay, layers, 0 in mine, S - 1 in mine, optimizer, runtime, len(mine), seq_len)
        params = layers * model.layer_params + model.vocab * model.hidden * ((0 in mine) + (S - 1 in mine))
        exposed = max(exposed, data_parallel_exposed_s(model, cluster, lay, layers, compute, one_bwd, runtime)
                      + optimizer_s(model, cluster, lay, params))
        _place_activations(mem, model, lay, c, sim, rank, mine, seq_len, dtype_bytes, runtime)
        live = sum(mem.values())
        transient = max([c.workspace[s] for s in mine] or [0.0])
        mem[RESERVE] = reserved_bytes(live, transient) - live
        if sum(mem.values()) > sum(worst.values()):
            worst = mem
    step = sim.makespan + exposed
    tokens = lay.m * lay.mb * seq_len * lay.dp
    total = sum(worst.values())
    fits = total <= cluster.hbm_bytes
    why = "fits" if fits else _overflow(worst, cluster.hbm_bytes, lay)
    return ClusterCandidate(lay, spec.name, step, tokens / step / cluster.gpus, worst, sim.bubble_fraction, fits,
                            why, cluster, seq_len)


def _place_activations(mem: dict[str, float], model: ModelShape, lay: ClusterLayout, c: LayoutCosts, sim: Simulation,
                       rank: int, mine: list[int], seq_len: int, dtype_bytes: int, runtime: Runtime | None) -> None:
    """Fill in ``mem``'s activations (and, where their timing decides, its unsharded gradients
    and parameters) at this rank's peak: under PP with FSDP from the simulated timeline, without
    PP with FSDP at the larger of the loss's and a block backward's moment
    (:func:`.memory.unsharded_without_pp`), otherwise the simulator's peak."""
    acts = "activations (in flight, from the simulator)"
    grads = _accumulated_grads(model, lay, c.layers, mine, runtime)
    peak = (sim.peak_bytes or {}).get(rank, 0.0)
    if grads:  # held from each stage's first backward to its last: found on the timeline
        key = next(k for k in mem if k.startswith("unsharded gradients"))
        peak, mem[key] = timeline_peak(sim.timeline.get(rank, []), c.held, c.workspace, grads)
        mem[acts] = peak - mem[key]
    elif lay.pp == 1 and lay.fsdp and lay.dp * lay.cp > 1:
        t = lay.mb * seq_len / lay.cp
        loss = loss_peak_bytes(model, t, lay, runtime or Runtime())
        rec = block_activation_bytes(model, t, lay.tp, dtype_bytes) if lay.recomputes else 0.0
        params, grad, work = unsharded_without_pp(model, lay, loss, rec)
        mem["unsharded parameters (bf16)"], mem["unsharded gradients (bf16)"] = params, grad
        mem[acts] = peak - c.workspace[0] + work
    else:
        mem[acts] = peak


def _accumulated_grads(model: ModelShape, lay: ClusterLayout, layers: list[int], mine: list[int],
                       runtime: Runtime | None) -> dict[int, float]:
    """Per stage of this rank, the unsharded gradient bytes FSDP2 accumulates across the step's
    microbatches under PP (none without PP or without sharding: then they are static)."""
    if lay.pp == 1 or not lay.fsdp or lay.dp * lay.cp == 1:
        return {}
    r = runtime or Runtime()
    last = lay.stages - 1
    out = {}
    for s in mine:
        params = layers[s] * model.layer_params + model.vocab * model.hidden * (
            (s == 0) + (s == last and not model.tied))
        out[s] = params / lay.tp * r.grad_accum_bytes
    return out


def _overflow(mem: dict[str, float], budget: float, lay: ClusterLayout) -> str:
    """What overflows by how much, and which knob would fix it."""
    over = sum(mem.values()) - budget
    part, size = max(mem.items(), key=lambda kv: kv[1])
    if "activations" in part or part == RESERVE:
        knob = "a smaller microbatch" if lay.mb > 1 else ("activation checkpointing" if lay.ac != "full" else "more pp")
    elif "kept" in part:
        knob = "fewer or smaller microbatches, or a runtime that frees each output after its backward"
    elif part.startswith("unsharded"):
        knob = "more pp or tp (fewer blocks held unsharded)"
    else:
        knob = "more GPUs, or more dp or tp (a finer shard)"
    return f"over by {over / GiB:.1f} GiB; largest: {part} {size / GiB:.1f} GiB; try {knob}"


def candidates(model: ModelShape, cluster: Cluster, global_seqs: int, *, schedules: Iterable[str] | None = None,
               microbatch_sizes: Sequence[int] = (1, 2), max_tp: int | None = None) -> list[tuple[ClusterLayout, str]]:
    """Every (layout, schedule) the search prices: meshes whose sizes divide the GPUs, TP
    inside a node dividing the heads, the batch split evenly over dp and microbatches."""
    out = []
    names = list(schedules) if schedules is not None else list(SCHEDULES)
    for tp in [d for d in _divisors(min(cluster.gpus_per_node, max_tp or cluster.gpus_per_node))
               if model.kv_heads % d == 0 or d % model.kv_heads == 0]:
        if model.heads % tp:
            continue
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            if global_seqs % dp or pp > model.layers:
                continue
            local = global_seqs // dp
            for mb in microbatch_sizes:
                if local % mb:
                    continue
                m = local // mb
                for name in names:
                    for v in SCHEDULES.get(name, (get_order_spec(name).default_stages_per_rank(),)):
                        if pp == 1 and (v > 1 or name != "1F1B"):
                            continue  # one stage per GPU: no pipeline, every schedule is the same
                        if pp * v > model.layers or m < pp:
                            continue
                        for ac in (True, False):
                            out.append((ClusterLayout(pp, dp, tp, v, m, mb, ac), name))
    return out


def plan_cluster(model: Any, cluster: Cluster, *, global_batch_tokens: int, seq_len: int, dtype: Any = None,
                 optimizer: str = "adamw", schedules: Iterable[str] | None = None,
                 microbatch_sizes: Sequence[int] = (1, 2), only: Iterable[tuple[ClusterLayout, str]] | None = None,
                 runtime: Runtime | None = None) -> ClusterPlan:
    """Rank every layout of ``model`` on ``cluster`` by predicted tokens/s/GPU (see
    :mod:`.costs` for the cost model).

    ``model``: ``"hf:DIR"`` (a ``config.json``), a transformers config, a model (meta device
    is enough: only ``.config`` is read) or a :class:`ModelShape`. ``dtype`` is the training
    dtype (bf16 assumed by the cost model). ``only`` prices just the given (layout, schedule)
    pairs (to check a published configuration); each must form the global batch exactly
    (``dp x m x mb`` sequences) on exactly the cluster's GPUs. ``runtime`` says how the
    training code runs (:class:`.runtime.Runtime`; default pippy_split's own).

    Raises:
        ValueError: nothing fits: names the closest layout, what overflows by how much and
            which knob would fix it; or an ``only`` layout that cannot form the batch.

    Example:
        >>> from pippy_split.plan.cluster import ModelShape
        >>> shape = ModelShape(layers=4, hidden=512, intermediate=2048, heads=8, kv_heads=8, vocab=1000)
        >>> plan_cluster(shape, Cluster.preset("h100x8"), global_batch_tokens=8 * 2048, seq_len=2048).best.fits
        True
    """
    import torch

    if dtype is not None and dtype is not torch.bfloat16:
        raise ValueError(f"plan_cluster prices bf16 training; got dtype={dtype}")
    shape = model_shape(model)
    if global_batch_tokens % seq_len:
        raise ValueError(f"global_batch_tokens {global_batch_tokens} is not a whole number of {seq_len}-token "
                         "sequences")
    if only is not None:
        only = list(only)
        for lay, _ in only:
            _check_forms_batch(lay, cluster, global_batch_tokens // seq_len)
    pairs = list(only) if only is not None else candidates(shape, cluster, global_batch_tokens // seq_len,
                                                           schedules=schedules, microbatch_sizes=microbatch_sizes)
    if not pairs:
        raise ValueError(f"no layout of {cluster.gpus} GPUs divides a batch of {global_batch_tokens // seq_len} "
                         f"sequences evenly over data-parallel ranks and microbatches: choose a batch that is a "
                         f"multiple of {cluster.gpus // cluster.gpus_per_node or 1} sequences")
    priced = []
    for lay, name in pairs:
        try:
            priced.append(price_layout(shape, cluster, lay, name, seq_len, optimizer, runtime=runtime))
        except ValueError:  # the schedule cannot run these sizes (e.g. DualPipeV needs m >= 2 pp - 1)
            if only is not None:
                raise
    if isinstance(model, str):
        for c in priced:
            c.model_ref = model
    priced.sort(key=lambda c: (not c.fits, -c.tokens_per_s_per_gpu if c.fits else c.memory_bytes))
    if only is None and not priced[0].fits:
        c = priced[0]
        raise ValueError(f"no layout fits in {cluster.hbm_bytes / GiB:.1f} GiB per GPU; closest: "
                         f"{' '.join(c.row()[:5])} needs {c.memory_bytes / GiB:.1f} GiB: {c.why}")
    return ClusterPlan(priced, cluster)


def _check_forms_batch(lay: ClusterLayout, cluster: Cluster, global_seqs: int) -> None:
    """Refuse, by name, a layout that does not form the global batch on the cluster's GPUs."""
    if lay.gpus != cluster.gpus:
        raise ValueError(f"only= layout pp{lay.pp} x dp{lay.dp} x cp{lay.cp} x tp{lay.tp} uses {lay.gpus} GPUs, but "
                         f"the cluster has {cluster.gpus}: choose sizes whose product is {cluster.gpus}")
    formed = lay.dp * lay.m * lay.mb
    if formed != global_seqs:
        raise ValueError(f"only= layout dp{lay.dp} x m{lay.m} x mb{lay.mb} forms a batch of {formed} sequences, not the "
                         f"global batch of {global_seqs}: choose m x mb = {global_seqs / lay.dp:g} per data-parallel "
                         f"rank" + ("" if global_seqs % lay.dp == 0 else f" (or a dp dividing {global_seqs})"))
