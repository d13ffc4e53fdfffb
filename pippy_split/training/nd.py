"""``pippy-split train --dp N --tp M``: pipeline x FSDP2 x tensor parallelism on a DeviceMesh.

Where this sits: between :func:`pippy_split.build_schedule` and the loop of
:mod:`pippy_split.training.loop`, on every rank. ``--ranks`` is the whole world: the
mesh is ``(dp, pp, tp)`` (tensor parallelism innermost, on the closest ranks, as
torchtitan lays it out), ``pp = ranks / (dp x tp)``. Each data-parallel replica is a
whole pipeline whose stages :func:`pippy_split.parallelize` shards with FSDP2 per
block (the model's largest ``nn.ModuleList``, e.g. ``model.layers.*``, then each stage
root) and splits with a tensor-parallel plan:

- a Llama-family model (Hugging Face ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/
  ``up_proj`` column-wise, ``o_proj``/``down_proj`` row-wise; the zoo's ``wq``...);
- the built-in TinyGPT: each block's MLP (``fc`` column-wise, ``proj`` row-wise;
  its attention has one fused ``qkv`` and stays whole).

The global batch of a step is ``dp x --batch-size`` rows: every rank draws the same
rows and replica ``r`` trains on the ``r``-th slice, so ``--dp 2 --batch-size 64``
trains on what ``--batch-size 128`` does (FSDP2 averages the replicas' gradients).

Example:
    >>> Layout.plain(2).pp, Layout.plain(2).dp
    (2, 1)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import pippy_split as ps

from ..zoo.entry import layer_split
from .config import TrainConfig
from .errors import JobError

if TYPE_CHECKING:
    from ..schedule.pipeline_schedule import PipelineSchedule

__all__ = ["Layout", "fsdp_patterns", "tp_plan_for", "parallelize_stages", "block_split"]

_HF_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_HF_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
_ZOO_COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
_ZOO_ROWWISE = ("attention.wo", "feed_forward.w2")
_GPT_COLWISE, _GPT_ROWWISE = ("mlp.fc",), ("mlp.proj",)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where this rank sits: pipeline, data-parallel and tensor-parallel sizes and places, the mesh."""

    pp: int
    """pipeline ranks (one replica's)"""
    dp: int = 1
    """data-parallel replicas"""
    tp: int = 1
    """tensor-parallel ranks per stage"""
    pp_rank: int = 0
    dp_rank: int = 0
    mesh: DeviceMesh | None = None
    """the ``(dp, pp, tp)`` DeviceMesh (None: a plain pipeline over the default group)"""

    @classmethod
    def plain(cls, world: int, rank: int = 0) -> Layout:
        return cls(pp=world, pp_rank=rank)

    @classmethod
    def of(cls, cfg: TrainConfig, world: int, rank: int, device: torch.device) -> Layout:
        """The run's layout on this rank (builds the mesh when ``--dp`` or ``--tp`` is over 1)."""
        if cfg.dp == 1 and cfg.tp == 1:
            return cls.plain(world, rank)
        if world % (cfg.dp * cfg.tp):
            raise JobError(f"{world} ranks cannot hold --dp {cfg.dp} x --tp {cfg.tp} (the world must be a multiple)")
        pp = world // (cfg.dp * cfg.tp)
        mesh = init_device_mesh(device.type, (cfg.dp, pp, cfg.tp), mesh_dim_names=("dp", "pp", "tp"))
        return cls(pp=pp, dp=cfg.dp, tp=cfg.tp, pp_rank=mesh.get_local_rank("pp"),
                   dp_rank=mesh.get_local_rank("dp"), mesh=mesh)

    @property
    def pp_group(self) -> Any:
        """The schedule's ``group=``: the mesh's ``pp`` dimension, or None (the default group)."""
        return None if self.mesh is None else self.mesh["pp"]

    def replica_rows(self, batch: int) -> slice:
        """This replica's rows of a global batch of ``dp x batch`` rows."""
        return slice(self.dp_rank * batch, (self.dp_rank + 1) * batch)

    def mean_over_replicas(self, value: float, device: torch.device) -> float:
        """The replicas' mean of a per-replica value (the step's loss over the global batch)."""
        if self.dp == 1 or self.mesh is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.mesh["dp"].get_group())
        return float(t.item()) / self.dp


def _block_list(model: torch.nn.Module) -> str | None:
    """The FQN of the model's largest ``nn.ModuleList`` (its blocks), or None."""
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m)]
    return max(lists)[1] if lists else None


def block_split(cfg: TrainConfig, model: torch.nn.Module, num_stages: int, given: Any) -> Any:
    """The run's split: every cut falls between blocks, so FSDP2 and TP apply to whole blocks (``--dp``/``--tp``)
    and the run can generate (each stage keeps the KV cache of its own blocks).

    ``given`` (the user's ``--split`` or a factory's FQNs) is kept (under ``--dp``/``--tp`` only where no cut
    enters a block, else refused by name); without one the blocks (the model's largest ``nn.ModuleList``) are
    dealt out evenly. A plain run of a model with fewer blocks than stages (or none) is balanced by cost
    (``num_stages``), which may cut inside blocks.

    Example:
        >>> from pippy_split.zoo.gpt import TinyGPT
        >>> gpt = TinyGPT(vocab_size=8, d_model=8, n_layer=4, n_head=2, block_size=8)
        >>> block_split(TrainConfig(dp=2), gpt, 2, None), block_split(TrainConfig(), gpt, 2, None)
        (['blocks.2'], ['blocks.2'])
        >>> block_split(TrainConfig(), gpt, 8, None)  # more stages than blocks: balanced by cost
        8
    """
    blocks = _block_list(model)
    n = len(cast(torch.nn.ModuleList, model.get_submodule(blocks))) if blocks is not None else 0
    if cfg.dp == 1 and cfg.tp == 1:
        if given:
            return given
        return layer_split(blocks, n, num_stages) if blocks is not None and n >= num_stages else num_stages
    flags = f"--dp {cfg.dp}" if cfg.tp == 1 else f"--tp {cfg.tp}" if cfg.dp == 1 else f"--dp {cfg.dp} --tp {cfg.tp}"
    if isinstance(given, (list, tuple, dict)) and given:  # FQNs (a dict's keys: FQN -> SplitPoint)
        inside = [c for c in given if blocks is not None and re.match(rf"{re.escape(blocks)}\.\d+\.", str(c))]
        if inside:
            raise JobError(f"{flags} shards whole blocks ({blocks}.*), so the split must fall between blocks; "
                           f"{', '.join(map(str, inside))} is inside one: split at blocks (e.g. "
                           f"{blocks}.1) or leave --split out")
        return given
    if n < num_stages:
        raise JobError(f"{flags} shards whole blocks, so each of the {num_stages} stages needs one: "
                       f"{type(model).__name__} has {n} ({blocks or 'no nn.ModuleList of blocks'}); use fewer "
                       "ranks, or a schedule with one stage per rank (1F1B)")
    assert blocks is not None
    return layer_split(blocks, n, num_stages)


def fsdp_patterns(model: torch.nn.Module) -> list[str] | None:
    """``["<blocks>.*"]``: each block is sharded on its own (None: only each stage root).

    Example:
        >>> from pippy_split.zoo.gpt import TinyGPT
        >>> fsdp_patterns(TinyGPT(vocab_size=8, d_model=8, n_layer=2, n_head=2, block_size=8))
        ['blocks.*']
    """
    blocks = _block_list(model)
    return None if blocks is None else [f"{blocks}.*"]


def tp_plan_for(model: torch.nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan for the model's blocks (see the module docstring); a JobError for a model
    with none of the known layouts."""
    blocks = _block_list(model)
    names = {n for n, _ in model.named_modules()}
    for colwise, rowwise in ((_HF_COLWISE, _HF_ROWWISE), (_ZOO_COLWISE, _ZOO_ROWWISE), (_GPT_COLWISE, _GPT_ROWWISE)):
        if blocks is not None and all(f"{blocks}.0.{m}" in names for m in colwise + rowwise):
            plan: dict[str, Any] = {f"{blocks}.*.{m}": ColwiseParallel() for m in colwise}
            plan.update({f"{blocks}.*.{m}": RowwiseParallel() for m in rowwise})
            return plan
    raise JobError(f"--tp: no tensor-parallel plan for {type(model).__name__}: the job knows Llama-family blocks "
                     "(q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj) and the built-in TinyGPT; build "
                     "other models' plans in Python with ps.parallelize(sched, tp_mesh=..., tp_plan=...)")


def check_tp_heads(model: torch.nn.Module, tp: int) -> None:
    """A Hugging Face config's heads must split evenly over the tensor-parallel ranks."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise JobError(f"--tp {tp}: {field} = {heads} does not split over {tp} ranks; choose a --tp dividing it")


def parallelize_stages(cfg: TrainConfig, sched: PipelineSchedule, model: torch.nn.Module, layout: Layout) -> None:
    """FSDP2 (``--dp``) and the tensor-parallel plan (``--tp``) on this rank's stages."""
    if layout.mesh is None:
        return
    plan = None
    if layout.tp > 1:
        check_tp_heads(model, layout.tp)
        plan = tp_plan_for(model)
    dp = layout.dp > 1
    ps.parallelize(sched, dp_mesh=layout.mesh["dp"] if dp else None, fsdp=fsdp_patterns(model) if dp else None,
                   tp_mesh=layout.mesh["tp"] if plan else None, tp_plan=plan)
