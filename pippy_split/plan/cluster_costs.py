"""What one layout costs on a cluster, from first principles: per-stage action times for
the simulator, message and collective times, and bytes per GPU.

Sits between :mod:`.cluster` / :mod:`.cluster_model` (the numbers) and
:mod:`.cluster_search` (which simulates each candidate's real order with these costs).

The model, stated (``b`` sequences of ``s`` tokens per microbatch, ``t = b s`` tokens,
width ``h``, ``tp``/``dp``/``pp`` the mesh, ``e`` the cluster's efficiency, bf16 = 2 bytes):

* **Compute (roofline).** A block's forward is ``2 P_layer t + 2 s h t`` FLOPs (matmuls, and
  causal attention's two ``s x s`` products halved), split ``tp`` ways; the last stage adds
  the output projection ``2 V h t``. An op takes ``max(FLOPs / (e x peak), bytes / hbm_bw)``,
  bytes being its weights and its input and output. Backward = 2 x forward, split evenly into
  I and W for zero-bubble orders; full activation checkpointing runs the forward again
  inside the backward (I, or B).
* **TP** (sequence parallel, Megatron): per block, forward and backward each move 2
  all-gathers and 2 reduce-scatters of ``t h`` bf16, each ``(tp-1)/tp`` of it per GPU, at
  the NVLink or NIC bandwidth by whether the TP group spans nodes (TP innermost, then DP,
  then PP). Not overlapped (async TP would hide part of it).
* **FSDP2** over ``dp``: each stage's parameters (its TP shard) are all-gathered once per
  step and its gradients reduce-scattered once (with PP the stage keeps them unsharded
  across microbatches), ``(dp-1)/dp`` of bf16 bytes each; overlapped with compute except
  the first block's all-gather and the last block's reduce-scatter, and any part longer
  than the rank's compute.
* **PP**: a microbatch's boundary activation ``t h / tp`` bf16 per message, plus the
  cluster's fixed cost per message (``p2p_latency``), as the simulator's link latency;
  each action also costs the cluster's ``action_overhead`` of host work (0 by default).
* **Memory per GPU**: parameters, fp32 gradients and optimizer state sharded over
  ``dp x tp`` (AdamW: 4 + 4 + 8 bytes per parameter, SGD 4 + 4); the rank's stages held
  unsharded in bf16 during the step (parameters and their gradients, TP-sharded; without
  PP only two blocks: the current and the prefetched one); activations per microbatch per
  stage (full AC: each block's input, ``t h / tp`` bf16; none: ``34 t h / tp`` bytes per
  block, Korthikanti et al. 2022 with flash attention) times what the simulator says is in
  flight on that rank; while a backward runs, one block's full activations (AC's
  recompute) and, on the last stage, fp32 logits ``4 t V / tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .cluster_model import ModelShape

__all__ = ["Layout", "StageCosts", "stage_costs", "block_forward_s", "static_bytes", "fsdp_exposed_s", "BF16"]

BF16 = 2
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0}
"""Optimizer state per parameter (fp32 moments), besides the fp32 master and gradient."""


@dataclass(frozen=True)
class Layout:
    """One mesh and how it runs: ``pp`` x ``dp`` x ``tp`` GPUs, ``v`` stages per pipeline rank,
    ``m`` microbatches of ``mb`` sequences, full activation checkpointing or none."""

    pp: int
    dp: int
    tp: int
    v: int
    m: int
    mb: int
    ac: bool

    @property
    def stages(self) -> int:
        return self.pp * self.v


@dataclass(frozen=True)
class StageCosts:
    """What the simulator takes for one layout: seconds per action kind and stage, the p2p
    latency, bytes held per microbatch and while a backward runs."""

    forward: list[float]
    backward: list[float]
    recompute: list[float]
    p2p_s: float
    held: list[float]
    workspace: list[float]
    layers: list[int]


def stage_layers(model: ModelShape, stages: int) -> list[int]:
    """Blocks per stage: as even as can be, the extra ones on the first stages."""
    base, extra = divmod(model.layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def block_forward_s(model: ModelShape, cluster: Cluster, tokens: int, seq_len: int, tp: int = 1,
                    dtype_bytes: int = BF16) -> float:
    """Seconds of one block's forward over ``tokens`` tokens (sequences of ``seq_len``), its
    TP traffic included (see the module docstring).

    Example:
        >>> shape = ModelShape(layers=1, hidden=256, intermediate=1024, heads=4, kv_heads=4, vocab=64, gated=False)
        >>> round(block_forward_s(shape, Cluster(gpus=1, flops=1e11, efficiency=1.0), 256, 128) * 1e3, 2)  # ms
        4.2
    """
    h, e = model.hidden, dtype_bytes
    layer_flops = (2 * model.layer_params * tokens + 2 * seq_len * h * tokens) / tp
    layer_bytes = (model.layer_params * e + 4 * tokens * h * e) / tp
    layer_f = max(layer_flops / (cluster.flops * cluster.efficiency), layer_bytes / cluster.hbm_bw)
    return layer_f + (0.0 if tp == 1 else 4 * (tp - 1) / tp * tokens * h * e / cluster.bandwidth(tp))


def stage_costs(model: ModelShape, cluster: Cluster, lay: Layout, seq_len: int, dtype_bytes: int = BF16) -> StageCosts:
    """Per-stage costs of ``lay`` (see the module docstring); ``dtype_bytes`` is the size of
    one weight or activation element in the training dtype (bf16: 2, fp32: 4)."""
    t = lay.mb * seq_len
    h, tp, e = model.hidden, lay.tp, dtype_bytes
    peak = cluster.flops * cluster.efficiency
    block_f = block_forward_s(model, cluster, t, seq_len, tp, e)
    head_flops = 2 * model.vocab * h * t / tp
    head_f = max(head_flops / peak, model.vocab * h * e / tp / cluster.hbm_bw)
    layers = stage_layers(model, lay.stages)
    fwd, bwd, rec, held, work = [], [], [], [], []
    for s, n in enumerate(layers):
        f = n * block_f + (head_f if s == lay.stages - 1 else 0.0)
        fwd.append(f)
        bwd.append(2 * f)
        rec.append(f if lay.ac else 0.0)
        block_all = 34 * t * h / tp
        held.append(n * (t * h * e / tp if lay.ac else block_all))
        logits = 4 * t * model.vocab / tp if s == lay.stages - 1 else 0.0
        work.append((block_all if lay.ac else 0.0) + logits)
    pp_span = lay.tp * lay.dp + 1  # neighbours in PP sit tp x dp ranks apart
    p2p = 0.0 if lay.pp == 1 else cluster.p2p_latency + t * h * e / tp / cluster.bandwidth(pp_span)
    return StageCosts(fwd, bwd, rec, p2p, held, work, layers)


def static_bytes(model: ModelShape, lay: Layout, layers_on_rank: int, first: bool, last: bool,
                 optimizer: str) -> dict[str, float]:
    """Bytes a GPU holds all step besides activations, by what they are."""
    extra = OPTIMIZER_BYTES.get(optimizer.lower())
    if extra is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_BYTES)}")
    params = layers_on_rank * model.layer_params
    params += model.vocab * model.hidden * ((1 if first else 0) + (1 if last and not model.tied else 0))
    shard = params / (lay.tp * lay.dp)
    held_blocks = layers_on_rank if lay.pp > 1 else min(2, layers_on_rank)
    unsharded = (held_blocks * model.layer_params + (params - layers_on_rank * model.layer_params)) / lay.tp
    return {"parameters + grads + optimizer (sharded)": shard * (4 + 4 + extra),
            "unsharded parameters (bf16)": unsharded * BF16 if lay.dp > 1 else 0.0,
            "unsharded gradients (bf16)": unsharded * BF16 if lay.dp > 1 else 0.0}


def fsdp_exposed_s(model: ModelShape, cluster: Cluster, lay: Layout, layers_on_rank: int, compute_s: float) -> float:
    """Seconds of FSDP2 traffic a step cannot hide (see the module docstring)."""
    if lay.dp == 1:
        return 0.0
    bw = cluster.bandwidth(lay.tp * lay.dp)
    per_block = model.layer_params / lay.tp * BF16 * (lay.dp - 1) / lay.dp / bw
    total = 2 * per_block * layers_on_rank
    return 2 * per_block + max(0.0, total - 2 * per_block - compute_s)
