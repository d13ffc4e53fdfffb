"""What one layout costs on a cluster: per-stage action times and held bytes for the
simulator, the pipeline's message time, and the data-parallel traffic a step cannot hide.

Sits between :mod:`.block` / :mod:`.memory` (one block's seconds and bytes) and
:mod:`.search` (which simulates each candidate's real order with these costs).

* **Stages** hold the blocks ``ClusterLayout.split`` says, or as even a split as can be;
  a stage's forward, backward and recomputation are its blocks' (:func:`.block.block_times`)
  plus, on the last stage, the output projection and the loss. Zero-bubble orders split a
  backward evenly into I and W; recomputation runs inside I (or B).
* **PP**: a microbatch's boundary activation ``t h / tp`` per message, plus the cluster's
  fixed cost per message (``p2p_latency``), as the simulator's link latency; each action
  also costs the cluster's ``action_overhead`` of host work (0 by default).
* **FSDP2** over ``dp x cp`` (a ring over ranks ``tp`` apart, at
  :meth:`.hardware.Cluster.collective_bandwidth`): each block's parameters all-gathered in bf16 for its forward
  (again for its backward without PP, where blocks reshard after forward) and its gradients
  reduce-scattered in ``r.grad_reduce_bytes``; with PP once per step per stage. Overlapped
  with compute except the first all-gather and the last reduce-scatter, and any part longer
  than the rank's compute. Each all-gather's copy-out is not overlapped: FSDP2 splits the
  gathered buffer into the unsharded parameters (``split_with_sizes_copy`` in
  ``foreach_all_gather_copy_out``) on the compute stream once the gather is waited, reading
  and writing every unsharded bf16 element (4 bytes a parameter through HBM, per gather). The
  reduce-scatter's copy-in runs on its own stream and stays hidden.
* **DP without FSDP** (distributed optimizer): the gradients reduce-scattered and the
  updated parameters all-gathered once per step, behind the last microbatch's backward and
  the first one's forward; what is longer shows.
* **Optimizer step**: memory-bound over the rank's shard (fp32 master, gradient and moments
  read, master and moments written, the bf16 copy written).

Example:
    >>> from .hardware import Cluster
    >>> from .shape import ModelShape
    >>> shape = ModelShape(layers=4, hidden=512, intermediate=2048, heads=8, kv_heads=8, vocab=1000)
    >>> lay = ClusterLayout(pp=2, dp=1, tp=1, v=1, m=4, mb=1, ac="full")
    >>> c = layout_costs(shape, Cluster(gpus=2), lay, 1024)
    >>> c.layers, c.recompute[0] == c.forward[0]
    ([2, 2], True)
"""

from __future__ import annotations

from dataclasses import dataclass

from .block import block_times, head_times
from .hardware import Cluster
from .kernels import link_s, memory_s
from .layout import ClusterLayout, stage_layers
from .memory import BF16, activation_bytes, block_activation_bytes, head_bytes, loss_peak_bytes
from .runtime import Runtime
from .shape import ModelShape

__all__ = ["LayoutCosts", "layout_costs", "data_parallel_exposed_s", "copy_out_s", "optimizer_s"]


@dataclass(frozen=True)
class LayoutCosts:
    """What the simulator takes for one layout: seconds per action kind and stage, the p2p
    latency, bytes held per microbatch and while a backward runs."""

    forward: list[float]
    backward: list[float]
    recompute: list[float]
    p2p_s: float
    held: list[float]
    workspace: list[float]
    layers: list[int]


def _stage_blocks(model: ModelShape, cluster: Cluster, lay: ClusterLayout, seq_len: int, r: Runtime,
                  n: int, dtype_bytes: int) -> tuple[float, float, float]:
    """Forward, backward and recompute seconds of ``n`` blocks (``selective-layer``: every
    second block fully checkpointed, the others not)."""
    if lay.ac == "selective-layer":
        full = block_times(model, cluster, lay, seq_len, r, "full", dtype_bytes)
        none = block_times(model, cluster, lay, seq_len, r, "none", dtype_bytes)
        k = n // 2
        return (k * full.forward + (n - k) * none.forward, k * full.backward + (n - k) * none.backward,
                k * full.recompute)
    b = block_times(model, cluster, lay, seq_len, r, None, dtype_bytes)
    return n * b.forward, n * b.backward, n * b.recompute


def layout_costs(model: ModelShape, cluster: Cluster, lay: ClusterLayout, seq_len: int, dtype_bytes: int = BF16,
                 runtime: Runtime | None = None) -> LayoutCosts:
    """Per-stage costs of ``lay`` (see the module docstring); ``dtype_bytes`` is the size of
    one weight or activation element in the training dtype (bf16: 2, fp32: 4)."""
    r = runtime or Runtime()
    t = lay.mb * seq_len / lay.cp
    h, tp, e = model.hidden, lay.tp, dtype_bytes
    head_f, head_b = head_times(model, cluster, lay, seq_len, r, dtype_bytes)
    layers = stage_layers(model.layers, lay.stages, lay.split)
    block_all = block_activation_bytes(model, t, tp, e)
    per_block = activation_bytes(model, t, tp, lay.ac_mode, e)
    _, head_keep = head_bytes(model, t, tp)
    loss = loss_peak_bytes(model, t, lay, r)
    fwd, bwd, rec, held, work = [], [], [], [], []
    for s, n in enumerate(layers):
        last = s == lay.stages - 1
        f, b, c = _stage_blocks(model, cluster, lay, seq_len, r, n, dtype_bytes)
        fwd.append(f + (head_f if last else 0.0))
        bwd.append(b + (head_b if last else 0.0))
        rec.append(c)
        held.append(n * per_block + (head_keep * e if last else 0.0))
        work.append(max(block_all if lay.recomputes and n else 0.0, loss if last else 0.0))
    pp_span = lay.tp * lay.cp * lay.dp + 1  # neighbours in PP sit tp x cp x dp ranks apart
    p2p = 0.0 if lay.pp == 1 else cluster.p2p_latency + t * h * e / tp / cluster.bandwidth(pp_span)
    return LayoutCosts(fwd, bwd, rec, p2p, held, work, layers)


def data_parallel_exposed_s(model: ModelShape, cluster: Cluster, lay: ClusterLayout, layers_on_rank: int,
                            compute_s: float, one_backward_s: float, runtime: Runtime | None = None) -> float:
    """Seconds of data-parallel traffic a step cannot hide (see the module docstring):
    ``compute_s`` is the rank's compute in the step, ``one_backward_s`` one microbatch's
    backward on it (what a distributed optimizer's reduce-scatter hides behind)."""
    r = runtime or Runtime()
    group = lay.dp * lay.cp
    if group == 1:
        return 0.0
    bw = cluster.collective_bandwidth(group, stride=lay.tp)
    block = model.layer_params / lay.tp * (group - 1) / group
    gather, reduce = link_s(block * BF16, bw), link_s(block * r.grad_reduce_bytes, bw)
    if not lay.fsdp:
        rs = reduce * layers_on_rank
        return max(0.0, rs - one_backward_s) + gather
    gathers = 1 if lay.pp > 1 else 2  # with PP a stage stays unsharded all step
    total = (gathers * gather + reduce) * layers_on_rank
    return gather + reduce + max(0.0, total - gather - reduce - compute_s) + copy_out_s(
        model, cluster, lay, gathers * layers_on_rank)


def copy_out_s(model: ModelShape, cluster: Cluster, lay: ClusterLayout, block_gathers: int) -> float:
    """Seconds of FSDP2's all-gather copy-outs on the compute stream: 2 bytes read and 2
    written per unsharded bf16 parameter, for ``block_gathers`` blocks gathered in the step
    (see the module docstring; none on a cluster priced at a flat measured efficiency).

    Example:
        >>> from .hardware import Cluster
        >>> shape = ModelShape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=32000)
        >>> lay = ClusterLayout(pp=1, dp=64, tp=1, v=1, m=1, mb=1, ac="full")
        >>> round(copy_out_s(shape, Cluster.preset("a100-80gb", gpus=64), lay, 2 * 80), 2)  # 70B, both gathers
        0.34
    """
    if cluster.efficiency is not None:
        return 0.0
    return memory_s(4 * BF16 / 2 * model.layer_params / lay.tp * block_gathers, cluster)


def optimizer_s(model: ModelShape, cluster: Cluster, lay: ClusterLayout, params_on_rank: float) -> float:
    """Seconds of the AdamW step over this GPU's shard: 30 bytes a parameter through HBM."""
    shard = params_on_rank / (lay.tp * lay.dp * lay.cp)
    return 0.0 if cluster.efficiency is not None else memory_s(30 * shard, cluster)
