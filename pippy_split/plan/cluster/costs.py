"""What one layout costs on a cluster, from first principles: per-stage action times for
the simulator, message and collective times, and bytes per GPU.

Sits between :mod:`.cluster` / :mod:`.cluster_model` (the numbers) and
:mod:`.cluster_search` (which simulates each candidate's real order with these costs).

The model, stated (``b`` sequences of ``s`` tokens per microbatch, ``t = b s`` tokens,
width ``h``, ``tp``/``dp``/``pp`` the mesh, ``e`` the cluster's efficiency, bf16 = 2 bytes):

* **Compute (roofline).** A block's forward is ``2 P_layer t + 2 s h t`` FLOPs (matmuls, and
  causal attention's two ``s x s`` products halved), split ``tp`` ways; the last stage adds
  the output projection ``2 V h t``. An op takes ``max(FLOPs / (e x peak), bytes / hbm_bw)``,
  bytes being its weights and its input and output; with the runtime's ``float8_linears``
  the block's projections (``2 P_layer t``) count against the cluster's ``fp8_flops``
  instead, attention and the output projection against ``flops``. Backward = 2 x forward
  plus flash attention's extra half of its forward FLOPs (its backward is 2.5 x), split
  evenly into I and W for zero-bubble orders; full activation checkpointing runs the
  forward again inside the backward (I, or B).
* **TP** (sequence parallel, Megatron): per block, forward and backward each move 2
  all-gathers and 2 reduce-scatters of ``t h`` bf16, each ``(tp-1)/tp`` of it per GPU, at
  the NVLink or NIC bandwidth by whether the TP group spans nodes (TP innermost, then DP,
  then PP). Added to the block's time: not overlapped (async TP would hide part of it).
* **FSDP2** over ``dp``: each stage's parameters (its TP shard) are all-gathered once per
  step and its gradients reduce-scattered once (with PP the stage keeps them unsharded
  across microbatches), ``(dp-1)/dp`` of bf16 bytes each; overlapped with compute except
  the first block's all-gather and the last block's reduce-scatter, and any part longer
  than the rank's compute.
* **PP**: a microbatch's boundary activation ``t h / tp`` bf16 per message, plus the
  cluster's fixed cost per message (``p2p_latency``), as the simulator's link latency;
  each action also costs the cluster's ``action_overhead`` of host work (0 by default).
  Stages hold the blocks ``Layout.split`` says, or as even a split as can be.
* **Memory per GPU** (``r`` = the :class:`.cluster_runtime.Runtime`):

  - parameters, fp32 gradients and optimizer state sharded over ``dp x tp`` (AdamW:
    4 master + 4 gradient + 8 moments bytes per parameter, SGD 4 + 4);
  - with FSDP (``dp > 1``) the blocks being used held unsharded, TP-sharded: with PP the
    rank's whole stages for the whole step (FSDP2 under PP neither reshards after forward
    nor after backward), parameters in bf16 and gradients in ``r.grad_accum_bytes``
    (they accumulate over the microbatches); without PP two blocks (the current and the
    prefetched one), both in bf16;
  - activations per microbatch per stage, times what the simulator says is in flight on
    that rank: full AC keeps each block's input, ``t h / tp`` bf16 (sequence parallel);
    without AC each block keeps what its backward reads (:func:`block_activation_bytes`);
    the last stage also keeps the output projection's input (gathered: ``t h``) and the
    final norm's (``t h / tp``);
  - while a backward runs, one block's full activations (AC's recompute), or on the last
    stage, if larger, the loss's peak: ``t V / tp`` logits of ``r.logits_bytes`` plus the
    loss's own ``r.loss_bytes`` per logit element;
  - with ``r.keeps_outputs`` (a runtime that keeps each microbatch's stage output until
    the step ends), ``m`` outputs per stage: boundary activations, and on the last stage
    the logits.

  The figure is live tensors (what ``torch.cuda.max_memory_allocated`` would report); a
  job's reserved memory (``max_memory_reserved``, what torchtitan prints) adds the caching
  allocator's fragmentation, which this model does not price.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .cluster_model import ModelShape
from .cluster_runtime import Runtime

__all__ = ["Layout", "StageCosts", "stage_costs", "block_forward_s", "attention_extra_backward_s", "block_activation_bytes", "static_bytes",
           "fsdp_exposed_s", "BF16"]

BF16 = 2
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0}
"""Optimizer state per parameter (fp32 moments), besides the fp32 master and gradient."""


@dataclass(frozen=True)
class Layout:
    """One mesh and how it runs: ``pp`` x ``dp`` x ``tp`` GPUs, ``v`` stages per pipeline rank,
    ``m`` microbatches of ``mb`` sequences, full activation checkpointing or none; ``split``
    the blocks of each stage (``None``: as even as can be, extra blocks on the first stages)."""

    pp: int
    dp: int
    tp: int
    v: int
    m: int
    mb: int
    ac: bool
    split: tuple[int, ...] | None = None

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


def stage_layers(model: ModelShape, stages: int, split: tuple[int, ...] | None = None) -> list[int]:
    """Blocks per stage: ``split`` if given, else as even as can be, the extra ones on the first stages."""
    if split is not None:
        if len(split) != stages or sum(split) != model.layers or min(split) < 0:
            raise ValueError(f"Layout.split {split} must give {stages} stages {model.layers} blocks in all")
        return list(split)
    base, extra = divmod(model.layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def block_forward_s(model: ModelShape, cluster: Cluster, tokens: int, seq_len: int, tp: int = 1,
                    dtype_bytes: int = BF16, float8: bool = False) -> float:
    """Seconds of one block's forward over ``tokens`` tokens (sequences of ``seq_len``), its
    TP traffic included; ``float8``: the projections at the cluster's ``fp8_flops`` (see the
    module docstring).

    Example:
        >>> shape = ModelShape(layers=1, hidden=256, intermediate=1024, heads=4, kv_heads=4, vocab=64, gated=False)
        >>> round(block_forward_s(shape, Cluster(gpus=1, flops=1e11, efficiency=1.0), 256, 128) * 1e3, 2)  # ms
        4.2
    """
    h, e = model.hidden, dtype_bytes
    linear_flops = 2 * model.layer_params * tokens / tp
    attention_flops = 2 * seq_len * h * tokens / tp
    linear_peak = cluster.fp8_flops if float8 and cluster.fp8_flops else cluster.flops
    flops_s = (linear_flops / linear_peak + attention_flops / cluster.flops) / cluster.efficiency
    layer_bytes = (model.layer_params * e + 4 * tokens * h * e) / tp
    layer_f = max(flops_s, layer_bytes / cluster.hbm_bw)
    return layer_f + (0.0 if tp == 1 else 4 * (tp - 1) / tp * tokens * h * e / cluster.bandwidth(tp))


def attention_extra_backward_s(model: ModelShape, cluster: Cluster, tokens: int, seq_len: int, tp: int = 1) -> float:
    """Seconds a block's backward spends beyond twice its forward: flash attention's backward
    recomputes ``Q K^T`` and runs five ``s x s`` matmuls to the forward's two, 2.5 x the
    forward's attention FLOPs (Dao 2023), where the rest of the block's backward is 2 x.

    Example:
        >>> shape = ModelShape(layers=1, hidden=256, intermediate=1024, heads=4, kv_heads=4, vocab=64)
        >>> round(attention_extra_backward_s(shape, Cluster(gpus=1, flops=1e11, efficiency=1.0), 256, 128) * 1e3, 3)
        0.084
    """
    return 0.5 * 2 * seq_len * model.hidden * tokens / tp / (cluster.flops * cluster.efficiency)


def block_activation_bytes(model: ModelShape, tokens: int, tp: int = 1, dtype_bytes: int = BF16) -> float:
    """Bytes one block's backward reads of its forward (its activations without checkpointing,
    or what AC's recompute rebuilds), TP with sequence parallel, flash attention.

    Gated (Llama) blocks, per token, in elements: the two norms' inputs (``h / tp`` each), their
    outputs as gathered for the projections (``h`` each), q, k, v after rotary and q, k before
    it (``(2 h + 3 kv) / tp``), the attention output (``h / tp``) and the MLP's four
    ``I / tp`` tensors (gate and up projections, the activation, their product). Plain (GPT)
    blocks: Korthikanti et al. 2022's ``34 t h / tp`` bytes.

    Example:
        >>> shape = ModelShape(layers=1, hidden=64, intermediate=256, heads=4, kv_heads=4, vocab=10)
        >>> block_activation_bytes(shape, 1)  # bytes per token: 2 x (10 x 64 + 4 x 256)
        3328.0
    """
    h, e = model.hidden, dtype_bytes
    if not model.gated:
        return 34 * tokens * h / tp * e / BF16
    kv = h * model.kv_heads // model.heads
    per_token = 2 * h + 2 * h / tp + (2 * h + 3 * kv) / tp + h / tp + 4 * model.intermediate / tp
    return float(tokens * per_token * e)


def _head_sizes(model: ModelShape, tokens: int, tp: int) -> tuple[float, float]:
    """Elements of the last stage's logits (``t V / tp``) and what its head keeps for backward
    (the output projection's gathered input ``t h``, the final norm's input ``t h / tp``)."""
    return tokens * model.vocab / tp, tokens * model.hidden * (1 + 1 / tp)


def stage_costs(model: ModelShape, cluster: Cluster, lay: Layout, seq_len: int, dtype_bytes: int = BF16,
                runtime: Runtime | None = None) -> StageCosts:
    """Per-stage costs of ``lay`` (see the module docstring); ``dtype_bytes`` is the size of
    one weight or activation element in the training dtype (bf16: 2, fp32: 4)."""
    r = runtime or Runtime()
    t = lay.mb * seq_len
    h, tp, e = model.hidden, lay.tp, dtype_bytes
    peak = cluster.flops * cluster.efficiency
    block_f = block_forward_s(model, cluster, t, seq_len, tp, e, r.float8_linears)
    block_b_extra = attention_extra_backward_s(model, cluster, t, seq_len, tp)
    head_flops = 2 * model.vocab * h * t / tp
    head_f = max(head_flops / peak, model.vocab * h * e / tp / cluster.hbm_bw)
    layers = stage_layers(model, lay.stages, lay.split)
    block_all = block_activation_bytes(model, t, tp, e)
    logits, head_keep = _head_sizes(model, t, tp)
    fwd, bwd, rec, held, work = [], [], [], [], []
    for s, n in enumerate(layers):
        last = s == lay.stages - 1
        f = n * block_f + (head_f if last else 0.0)
        fwd.append(f)
        bwd.append(2 * f + n * block_b_extra)
        rec.append(f if lay.ac else 0.0)
        held.append(n * (t * h * e / tp if lay.ac else block_all) + (head_keep * e if last else 0.0))
        loss = logits * ((0 if r.keeps_outputs and lay.pp > 1 else r.logits_bytes) + r.loss_bytes) if last else 0.0
        work.append(max(block_all if lay.ac and n else 0.0, loss))
    pp_span = lay.tp * lay.dp + 1  # neighbours in PP sit tp x dp ranks apart
    p2p = 0.0 if lay.pp == 1 else cluster.p2p_latency + t * h * e / tp / cluster.bandwidth(pp_span)
    return StageCosts(fwd, bwd, rec, p2p, held, work, layers)


def static_bytes(model: ModelShape, lay: Layout, layers_on_rank: int, first: bool, last: bool,
                 optimizer: str, runtime: Runtime | None = None, stages_on_rank: int = 1,
                 seq_len: int = 0) -> dict[str, float]:
    """Bytes a GPU holds all step besides in-flight activations, by what they are (``seq_len``
    sizes the outputs a runtime with ``keeps_outputs`` holds)."""
    r = runtime or Runtime()
    extra = OPTIMIZER_BYTES.get(optimizer.lower())
    if extra is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_BYTES)}")
    params = layers_on_rank * model.layer_params
    params += model.vocab * model.hidden * ((1 if first else 0) + (1 if last and not model.tied else 0))
    shard = params / (lay.tp * lay.dp)
    held_blocks = layers_on_rank if lay.pp > 1 else min(2, layers_on_rank)
    unsharded = (held_blocks * model.layer_params + (params - layers_on_rank * model.layer_params)) / lay.tp
    grad_bytes = r.grad_accum_bytes if lay.pp > 1 else BF16
    out = {"parameters + grads + optimizer (sharded)": shard * (4 + 4 + extra),
           "unsharded parameters (bf16)": unsharded * BF16 if lay.dp > 1 else 0.0,
           f"unsharded gradients ({'fp32' if grad_bytes == 4 else 'bf16'})":
               unsharded * grad_bytes if lay.dp > 1 else 0.0}
    if r.keeps_outputs and lay.pp > 1:
        t = lay.mb * seq_len
        logits, _ = _head_sizes(model, t, lay.tp)
        boundary = (stages_on_rank - (1 if last else 0)) * t * model.hidden / lay.tp * BF16
        out["stage outputs kept until the step ends"] = lay.m * (boundary + (logits * r.logits_bytes if last else 0.0))
    return out


def fsdp_exposed_s(model: ModelShape, cluster: Cluster, lay: Layout, layers_on_rank: int, compute_s: float) -> float:
    """Seconds of FSDP2 traffic a step cannot hide (see the module docstring)."""
    if lay.dp == 1:
        return 0.0
    bw = cluster.bandwidth(lay.tp * lay.dp)
    per_block = model.layer_params / lay.tp * BF16 * (lay.dp - 1) / lay.dp / bw
    total = 2 * per_block * layers_on_rank
    return 2 * per_block + max(0.0, total - 2 * per_block - compute_s)
