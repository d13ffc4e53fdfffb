"""One transformer block's forward, backward and recomputation on one GPU, as the kernels
it runs (:mod:`.kernels`): its matmuls by shape, flash attention, the elementwise passes,
Float8's casts, TP's and CP's transfers. Also the output head and the loss.

Sits between :mod:`.kernels` and :mod:`.costs` (which adds the blocks up into stages).

Per microbatch, ``t`` tokens on this GPU (``mb x seq / cp``), width ``h``, MLP width ``I``,
``kv`` = KV heads x head dim, a Llama block's matmuls are q ``(t, h, h/tp)``, k and v
``(t, h, kv/tp)``, o ``(t, h/tp, h)``, gate and up ``(t, h, I/tp)``, down ``(t, I/tp, h)``
(a GPT block: q, k, v, o, up and down). Backward runs two matmuls per forward one (input
gradient ``(t, N, K)``, weight gradient ``(K, t, N)``), attention 2.5 x its forward.

Elementwise bytes per token, counted from the ops (bf16 = 2, fp32 = 4 bytes an element):
eager (each op its own kernel) an RMSNorm reads and writes ``h`` about 36 bytes (a fp32
copy, square, mean, scale, cast back, weight), two of them 72; rotary on q and k 20 per
element (fp32 round trip); the residual adds 12; layout copies for attention 4 per q
element and 8 per k/v one; SwiGLU 10 per ``I`` element: ``108 h + 28 kv + 10 I`` forward.
Fused (compile or Transformer Engine): each norm reads and writes once (4 per ``h``, two of
them), each residual add fused into a norm still reads two and writes one (6, two of them),
rotary 4 per q and k element, the layout copies as eager, SwiGLU reads two and writes one
(6 per ``I``): ``28 h + 12 kv + 6 I``. Backward moves twice the forward's bytes;
recomputation (full or selective AC) the forward's again. Float8's scaling moves the
runtime's ``float8_cast_bytes`` per operand element eager, and ``FUSED_FLOAT8_CAST_BYTES``
when the amax and the cast fuse into the op before them (compile). Under TP, Float8's
all-gathers move fp8 (torchao casts before the gather), its reduce-scatters bf16.

Example:
    >>> from .hardware import Cluster
    >>> from .shape import ModelShape
    >>> from .layout import ClusterLayout
    >>> from .runtime import Runtime
    >>> shape = ModelShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
    >>> lay = ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=2, ac="none")
    >>> eager = block_times(shape, Cluster(gpus=8), lay, 8192, Runtime())
    >>> fused = block_times(shape, Cluster(gpus=8), lay, 8192, Runtime(fused_elementwise=True))
    >>> fused.forward < eager.forward
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster
from .kernels import KERNELS, attention_s, gemm_s, link_s, memory_s
from .layout import ClusterLayout
from .runtime import Runtime
from .shape import ModelShape

__all__ = ["BlockTimes", "block_times", "head_times", "block_matmuls", "ring_correction_s", "ELEMENTWISE_BYTES",
           "RING_CORRECTION_BYTES"]

ELEMENTWISE_BYTES = {False: (108.0, 28.0, 10.0), True: (28.0, 12.0, 6.0)}
"""Forward elementwise HBM bytes per token per block, as ``(per h, per kv, per I)``
element: eager (``False``) and fused (``True``); see the module docstring."""
FUSED_FLOAT8_CAST_BYTES = 3.0
"""Bytes per operand element Float8 scaling moves when compiled: the cast writes fp8 from the
kernel before it, the amax reads once more, the transposed copy for the backward."""
RING_CORRECTION_BYTES = 10.0
"""HBM bytes per element of a rank's attention output (``t x h / tp``) that ring attention
moves in each round after the first to fold the round's partial result into the running one:
the round's bf16 output read (2) and the fp32 accumulator read and written (4 + 4), rescaled
by the two logsumexps (per token and head: negligible). torch's ring
(``_SDPAMerger._merge_one``, ``convert_to_f32=True``) and Transformer Engine's
(``flash_attn_fwd_out_correction``) both do this once per round; the backward accumulates the
query gradient and the K/V gradients passed around the ring the same way (twice the bytes)."""
SAC_OP_RECOMPUTED = (1, 3, 5)
"""torchtitan's op-level selective AC keeps every matmul's output except every second one:
of q, k, v, o, gate, up, down (in call order) it recomputes k, o and up."""


@dataclass(frozen=True)
class BlockTimes:
    """Seconds of one block for one microbatch on one GPU."""

    forward: float
    backward: float
    recompute: float
    """What activation checkpointing reruns inside the backward."""


def block_matmuls(model: ModelShape, tokens: float, tp: int) -> list[tuple[float, float, float]]:
    """The block's forward matmuls as ``(M, K, N)`` on one GPU, in call order.

    Example:
        >>> from .shape import ModelShape
        >>> len(block_matmuls(ModelShape(layers=1, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=4), 4, 1))
        7
    """
    h, i = model.hidden, model.intermediate
    kv = h * model.kv_heads // model.heads
    attn = [(tokens, h, h / tp), (tokens, h, kv / tp), (tokens, h, kv / tp), (tokens, h / tp, h)]
    mlp = [(tokens, h, i / tp)] * (2 if model.gated else 1) + [(tokens, i / tp, h)]
    return attn + mlp


def _elementwise_bytes(model: ModelShape, tokens: float, tp: int, runtime: Runtime) -> float:
    a_h, a_kv, a_i = ELEMENTWISE_BYTES[runtime.fused_elementwise]
    kv = model.hidden * model.kv_heads // model.heads
    return tokens * (a_h * model.hidden + a_kv * kv + a_i * model.intermediate) / tp


def _float8_cast_bytes(mms: list[tuple[float, float, float]], runtime: Runtime, tp: int = 1) -> tuple[float, float]:
    """Forward and backward bytes Float8 scaling moves: each matmul's weight and each distinct
    input forward, its output gradient and weight again backward (see :class:`.runtime.Runtime`).

    q, k and v read one input, the MLP's gate and up another. Eager, each Float8 linear casts
    its own; compiled (``fused_elementwise``) the repeated amax and cast of one tensor are one
    (common subexpressions of the block's graph, as Transformer Engine's fused QKV and fc1 cast
    once), and under TP the shared input is cast once on its sequence shard, before the fp8
    all-gather (torchao's ``PrepareFloat8ModuleInput``)."""
    c = min(runtime.float8_cast_bytes, FUSED_FLOAT8_CAST_BYTES) if runtime.fused_elementwise else runtime.float8_cast_bytes
    inputs = sum(m * k for m, k, _ in mms)
    if runtime.fused_elementwise or tp > 1:
        shared = [0, 4]  # q's input (k, v read it too) and the MLP's first (up reads it too, gated)
        inputs = sum(mms[i][0] * mms[i][1] / (tp if i in shared else 1) for i in (0, 3, 4, len(mms) - 1))
    fwd = c * (inputs + sum(k * n for _, k, n in mms))
    bwd = sum(c * (m * n + k * n) for m, k, n in mms)
    return fwd, bwd


def _tp_s(model: ModelShape, cluster: Cluster, lay: ClusterLayout, tokens: float, matmul_s: float,
          runtime: Runtime, dtype_bytes: int = 2) -> float:
    """Exposed seconds of TP's two all-gathers and two reduce-scatters of ``t h`` bf16 in one
    forward (sequence parallel); async TP hides all but one chunk behind the matmuls."""
    if lay.tp == 1:
        return 0.0
    gather_bytes = 1 if runtime.float8_linears and cluster.efficiency is None else dtype_bytes
    one = (lay.tp - 1) / lay.tp * tokens * model.hidden
    bw = cluster.collective_bandwidth(lay.tp)
    comm = 2 * link_s(one * gather_bytes, bw) + 2 * link_s(one * dtype_bytes, bw)
    if runtime.async_tp:
        return max(comm / lay.tp, comm - KERNELS.overlap_fraction * min(comm, matmul_s))
    return comm


def _cp_s(model: ModelShape, cluster: Cluster, lay: ClusterLayout, tokens: float, attention: float) -> float:
    """Seconds ring attention adds to one forward besides its FLOPs: the exposed part of the
    K/V rotation (``cp - 1`` rounds of this rank's K and V, each overlapped with a round of
    attention) and, in each of those rounds, the correction that folds the round's partial
    output into the running one (:func:`ring_correction_s`).

    With load balancing (each rank holds chunks ``r`` and ``2 cp - 1 - r``; torch's default) a
    rank's rounds are one causal block of its ``t`` tokens and ``cp - 1`` half blocks, so at a
    fixed ``t`` every round has one shape and costs the same whatever ``cp`` is; on NVLink an
    exchange is a few percent of its round. torchtitan's Table 2 (same ``t`` at CP 1-8) is not
    met by such a cost: its CP 2 step is cheaper per round than its CP 4 and CP 8 steps
    (see ``tests/plan/test_plan_cluster_published.py``)."""
    if lay.cp == 1:
        return 0.0
    kv = model.hidden * model.kv_heads // model.heads
    one = link_s(2 * tokens * kv / lay.tp * 2, cluster.bandwidth(lay.tp * lay.cp))
    rotation = one + max(0.0, (lay.cp - 2) * one - attention * (lay.cp - 2) / lay.cp)
    return rotation + ring_correction_s(model, cluster, lay, tokens)


def ring_correction_s(model: ModelShape, cluster: Cluster, lay: ClusterLayout, tokens: float) -> float:
    """Seconds of ring attention's per-round output correction in one forward on one GPU:
    :data:`RING_CORRECTION_BYTES` per element of the rank's ``tokens x h / tp`` output in each
    of the ``cp - 1`` rounds after the first, through HBM (0 without CP, or at a flat measured
    efficiency). A round's bytes grow as ``t h`` and its attention FLOPs as ``t^2 h``: the
    correction is about 2% of a round at torchtitan's 32k tokens a GPU (Table 2), about 20%
    at NeMo's 4k (Llama 3 at CP 2).

    Example:
        >>> shape = ModelShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
        >>> lay = ClusterLayout(pp=1, dp=4, tp=1, v=1, m=1, mb=1, ac="full", cp=2)
        >>> round(ring_correction_s(shape, Cluster(gpus=8), lay, 32768) * 1e3, 2)  # ms: one round, H100 HBM3
        0.5
    """
    if lay.cp == 1 or cluster.efficiency is not None:
        return 0.0
    return memory_s(RING_CORRECTION_BYTES * tokens * model.hidden / lay.tp * (lay.cp - 1), cluster)


def block_times(model: ModelShape, cluster: Cluster, lay: ClusterLayout, seq_len: int, runtime: Runtime,
                ac: str | None = None, dtype_bytes: int = 2) -> BlockTimes:
    """Seconds of one block's forward, backward and recomputation for one microbatch
    (``ac`` overrides the layout's mode, for a block that ``selective-layer`` treats apart;
    ``dtype_bytes``: the size of an activation element, 4 for fp32 training)."""
    tokens = lay.mb * seq_len / lay.cp
    mode = ac or lay.ac
    fp8 = runtime.float8_linears
    asyncs = runtime.async_tp and lay.tp > 1
    split = lay.tp if asyncs else 1  # async TP runs each matmul in tp chunks along its tokens
    mms = block_matmuls(model, tokens, lay.tp)
    fwd_mm = [split * gemm_s(m / split, n, k, cluster, fp8) for m, k, n in mms]
    bwd_mm = sum(split * gemm_s(m / split, k, n, cluster, fp8) + gemm_s(k, n, m, cluster, fp8) for m, k, n in mms)
    width = model.hidden / lay.tp
    chunk = seq_len / lay.cp  # what one attention call sees per sequence (a ring round's blocks)
    attn_f = attention_s(tokens, seq_len, width, cluster, runtime.attention_kernel, block_len=chunk)
    attn_b = attention_s(tokens, seq_len, width, cluster, runtime.attention_kernel, backward=True, block_len=chunk)
    flat = cluster.efficiency is not None
    elem = 0.0 if flat else memory_s(_elementwise_bytes(model, tokens, lay.tp, runtime), cluster)
    cast_f, cast_b = _float8_cast_bytes(mms, runtime, lay.tp) if fp8 and not flat else (0.0, 0.0)
    if flat:  # the old roofline over the whole block: its weights and four t x h activations
        moved = (model.layer_params + 4 * tokens * model.hidden) * dtype_bytes / lay.tp
        compute_f = max(sum(fwd_mm) + attn_f, moved / cluster.hbm_bw)
    else:
        compute_f = sum(fwd_mm) + attn_f + elem + memory_s(cast_f, cluster)
    tp_f = _tp_s(model, cluster, lay, tokens, sum(fwd_mm), runtime, dtype_bytes)
    cp_f = _cp_s(model, cluster, lay, tokens, attn_f)
    forward = compute_f + tp_f + cp_f
    if flat:  # the old rule: backward = 2 x forward plus flash attention's extra half
        backward = 2 * forward + 0.5 * attn_f
    else:
        backward = (bwd_mm + attn_b + 2 * elem + memory_s(cast_b, cluster) + 2 * cp_f
                    + _tp_s(model, cluster, lay, tokens, bwd_mm / 2, runtime, dtype_bytes))
    if mode == "full":
        recompute = forward
    elif mode == "selective-op":
        recompute = sum(fwd_mm[i] for i in SAC_OP_RECOMPUTED if i < len(fwd_mm)) + elem
    else:
        recompute = 0.0
    return BlockTimes(forward, backward, recompute)


def head_times(model: ModelShape, cluster: Cluster, lay: ClusterLayout, seq_len: int,
               runtime: Runtime, dtype_bytes: int = 2) -> tuple[float, float]:
    """Forward and backward seconds of the output projection ``(t, h, V/tp)`` (bf16) and the
    loss over its logits (memory-bound: about 40 bytes per logit element through a fp32
    log-softmax and its gradient; 12 for a fused cross-entropy on bf16 logits)."""
    tokens = lay.mb * seq_len / lay.cp
    m, k, n = tokens, model.hidden, model.vocab / lay.tp
    if cluster.efficiency is not None:
        f = max(2 * m * k * n / (cluster.flops * cluster.efficiency), k * n * dtype_bytes / cluster.hbm_bw)
        return f, 2 * f
    loss = memory_s(m * n * (40 if runtime.logits_bytes == 4 else 12), cluster)
    return gemm_s(m, n, k, cluster) + loss / 3, gemm_s(m, k, n, cluster) + gemm_s(k, n, m, cluster) + 2 * loss / 3
