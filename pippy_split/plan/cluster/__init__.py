"""Planning a cluster job on paper (``ps.plan_cluster``): which mesh, schedule, stages per
rank, microbatches and activation checkpointing for a decoder on a cluster, with the step
time and the memory each GPU reserves, before there is a cluster.

The rooms, in the order a price is made: :mod:`.hardware` (the cluster's numbers,
:class:`Cluster`), :mod:`.shape` (a decoder's shape from its config, :class:`ModelShape`),
:mod:`.runtime` (what the training code does, :class:`Runtime`), :mod:`.layout` (one mesh
and how it runs, :class:`ClusterLayout`), :mod:`.kernels` (one kernel's seconds by its
shape: the one set of constants), :mod:`.block` (one block's forward, backward and
recompute as kernels), :mod:`.memory` (bytes held, and the caching allocator's reserve),
:mod:`.costs` (per-stage costs for the simulator, data-parallel traffic), :mod:`.search`
(each layout's order simulated; the ranked plan).

Example:
    >>> import pippy_split as ps
    >>> shape = ps.ModelShape(layers=8, hidden=1024, intermediate=4096, heads=8, kv_heads=8, vocab=32000)
    >>> lay = ps.ClusterLayout(pp=2, dp=4, tp=2, v=1, m=8, mb=1, ac="full")
    >>> plan = ps.plan_cluster(shape, ps.Cluster.preset("h100x16"), global_batch_tokens=32 * 4096,
    ...                        seq_len=4096, only=[(lay, "1F1B")])
    >>> plan.best.fits
    True
"""

from .hardware import PRESETS, Cluster
from .layout import AC_MODES, ClusterLayout
from .runtime import RUNTIMES, Runtime
from .search import SCHEDULES, ClusterCandidate, ClusterPlan, plan_cluster, price_layout
from .shape import ModelShape, model_shape

__all__ = ["Cluster", "PRESETS", "ModelShape", "model_shape", "Runtime", "RUNTIMES", "ClusterLayout", "AC_MODES",
           "ClusterCandidate", "ClusterPlan", "plan_cluster", "price_layout", "SCHEDULES"]
