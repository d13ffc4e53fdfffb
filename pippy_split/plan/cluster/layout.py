"""One way to lay a job over a cluster (:class:`ClusterLayout`): the mesh (pp x dp x cp x tp
GPUs), how the pipeline runs (stages per rank, microbatches), what is recomputed, and
whether data parallelism shards (FSDP) or replicates.

Sits under :mod:`.costs` and :mod:`.search`; knows no hardware.

Example:
    >>> lay = ClusterLayout(pp=8, dp=8, tp=8, v=2, m=8, mb=4, ac="full")
    >>> lay.stages, lay.gpus, lay.ac
    (16, 512, 'full')
    >>> ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=1, ac=False).ac
    'none'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClusterLayout", "AC_MODES", "stage_layers"]

AC_MODES = ("none", "full", "selective-op", "selective-layer")
"""Activation checkpointing: none; every block's whole forward recomputed in its backward
(``"full"``); torchtitan's op-level selective AC (``"selective-op"``: matmul outputs kept
except every second one, attention's output kept, the rest recomputed); torchtitan's
layer-level selective AC (``"selective-layer"``: every second block fully checkpointed)."""


@dataclass(frozen=True)
class ClusterLayout:
    """One mesh and how it runs: ``pp`` x ``dp`` x ``cp`` x ``tp`` GPUs, ``v`` stages per
    pipeline rank, ``m`` microbatches of ``mb`` sequences per data-parallel rank and step,
    activation checkpointing ``ac`` (one of :data:`AC_MODES`; ``True``/``False`` mean
    ``"full"``/``"none"``); ``split`` the blocks of each stage (``None``: as even as can be,
    extra blocks on the first stages); ``cp`` context-parallel ranks sharing each sequence
    (ring attention); ``fsdp`` whether the data-parallel ranks shard parameters, gradients and
    optimizer state (FSDP2), or replicate the parameters and shard only the optimizer state
    (``False``: DDP with a distributed optimizer, as Megatron / NeMo run)."""

    pp: int
    dp: int
    tp: int
    v: int
    m: int
    mb: int
    ac: bool | str
    split: tuple[int, ...] | None = None
    cp: int = 1
    fsdp: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.ac, bool):
            object.__setattr__(self, "ac", "full" if self.ac else "none")
        if self.ac not in AC_MODES:
            raise ValueError(f"ClusterLayout: ac={self.ac!r} is not one of {', '.join(AC_MODES)}")
        if min(self.pp, self.dp, self.tp, self.v, self.m, self.mb, self.cp) < 1:
            raise ValueError(f"ClusterLayout: every size must be >= 1, got {self}")

    @property
    def ac_mode(self) -> str:
        """``ac`` as one of :data:`AC_MODES` (a bool given at construction is normalized)."""
        return str(self.ac)

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp x v``)."""
        return self.pp * self.v

    @property
    def gpus(self) -> int:
        """GPUs the layout uses."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def recomputes(self) -> bool:
        """Whether any of the forward is recomputed in the backward."""
        return self.ac != "none"


def stage_layers(layers: int, stages: int, split: tuple[int, ...] | None = None) -> list[int]:
    """Blocks per stage: ``split`` if given, else as even as can be, the extra ones first.

    Example:
        >>> stage_layers(10, 4)
        [3, 3, 2, 2]
    """
    if split is not None:
        if len(split) != stages or sum(split) != layers or min(split) < 0:
            raise ValueError(f"ClusterLayout.split {split} must give {stages} stages {layers} blocks in all")
        return list(split)
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]
