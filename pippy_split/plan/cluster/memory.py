"""Bytes one GPU holds: what lives all step (parameters, gradients, optimizer state, what
the runtime keeps), what each microbatch in flight holds for its backward, what a backward
needs while it runs, and what the CUDA caching allocator reserves around all that.

Sits under :mod:`.costs` (held and workspace bytes per stage, for the simulator) and
:mod:`.search` (a rank's static bytes and the reserved figure).

The model, stated (``t`` tokens per microbatch on this GPU, ``e`` bytes an activation
element, ``r`` the :class:`.runtime.Runtime`):

* **States.** With FSDP, parameters, fp32 gradients and optimizer state sharded over the
  ``dp x cp`` ranks and TP (AdamW: 4 master + 4 gradient + 8 moments bytes a parameter), and
  the blocks in use unsharded: with PP the rank's whole stages all step, parameters in bf16
  and gradients in ``r.grad_accum_bytes`` (FSDP2 under PP reshards neither after forward
  nor after backward), without PP two blocks (current and prefetched). Without FSDP
  (``fsdp=False``: DDP with a distributed optimizer) bf16 parameters and a gradient buffer
  of ``r.grad_accum_bytes`` replicated, fp32 master weights and moments sharded over
  ``dp x cp``.
* **Activations per microbatch and block** (:func:`activation_bytes`): full AC keeps the
  block's input, ``t h / tp``; none what the backward reads (:func:`block_activation_bytes`);
  torchtitan's op-level selective AC what its policy saves: the block's input (``h``, held by
  the checkpoint), the outputs of the matmuls it keeps (q, v, gate, down: ``2 h + kv + I``)
  and attention's output (``h``), ``t (4 h + kv + I) / tp``; everything else, the residual
  sum between attention and the MLP included, is an elementwise op and recomputed;
  layer-level selective AC the mean of full and none. The last stage also keeps the output projection's input.
* **While a backward runs**: a recomputed block's full activations, or on the last stage
  the loss's peak, ``t V / tp`` logits of ``r.logits_bytes`` plus ``r.loss_bytes``
  (``r.loss_parallel_bytes`` under TP > 1) per logit.
* **Kept outputs** (``r.keeps_outputs``): each microbatch's stage output until the step ends.
* **When gradients exist** (:func:`timeline_peak`): under PP with FSDP a stage's unsharded
  gradients are allocated at its first weight-gradient backward and freed (reduce-scattered)
  after its last, so the rank's peak is found on its simulated timeline, activations and
  gradients together: on 1F1B's first rank the whole stage's gradients arrive while all its
  warm-up microbatches are held; an interleaved rank's second stage starts its backward later.
* **FSDP without PP** (:func:`unsharded_without_pp`): the rank's peak is the larger of two
  moments. At the loss (the start of the backward, every block's activations held) only
  FSDP2's root group (embedding, final norm, output projection: the root is never resharded
  after forward) and the last block (torchtitan leaves it unsharded; a prefetch would bring it
  back at once) are unsharded, and no unsharded gradient exists yet: the backward has not
  reached a parameter. In a block's backward, that block and the one prefetched are
  unsharded, with the gradients of that block, of the one being reduce-scattered and of the
  output projection (its group reduces only when the embedding's gradient, the last, is done).
* **Reserved** (:func:`reserved_bytes`; what ``torch.cuda.max_memory_reserved`` reports and
  torchtitan prints): the caching allocator never returns a freed block to the driver during
  a step and reuses it only for a request it can hold; a block freed by a microbatch's
  transient tensors (the loss's fp32 copies, a recomputed block) is split to serve the
  longer-lived tensors allocated next (the next microbatch's activations, a kept output),
  so the next transient of that size finds no block whole and the allocator maps a new one.
  Reserved = the live peak plus ``ALLOCATOR_SPLIT_FRACTION`` of the largest transient.
  Published allocated/reserved pairs show the reserve is real and tied to transients, not to
  what lives: FSDP's all-gathers at microbatch 1 (pytorch/pytorch#137151: 1.75 GiB active,
  2.67 reserved), a 70B fine-tune (meta-llama/llama-cookbook#120: 42 GB allocated, 63
  reserved). The fraction is one constant, chosen with the kernels' over every published
  memory figure at once (``benchmarks.published_runs``). Of the 9.8 GiB torchtitan's 405B
  1F1B run reserved beyond its Interleaved1F1B run, the gradients' timing gives 3.9.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...schedule import Action
from ...schedule.actions import ActionKind
from .layout import ClusterLayout
from .runtime import Runtime
from .shape import ModelShape

__all__ = ["activation_bytes", "block_activation_bytes", "head_bytes", "static_bytes", "reserved_bytes", "timeline_peak",
           "unsharded_without_pp", "ALLOCATOR_SPLIT_FRACTION", "OPTIMIZER_BYTES", "BF16"]

BF16 = 2
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0}
"""Optimizer state per parameter (fp32 moments), besides the fp32 master and gradient."""
ALLOCATOR_SPLIT_FRACTION = 0.2
"""The share of the largest transient allocation the caching allocator holds reserved beyond
the live peak (see the module docstring)."""


def block_activation_bytes(model: ModelShape, tokens: float, tp: int = 1, dtype_bytes: int = BF16) -> float:
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


def activation_bytes(model: ModelShape, tokens: float, tp: int, ac: str, dtype_bytes: int = BF16) -> float:
    """Bytes one block keeps for its backward per microbatch under activation checkpointing
    ``ac`` (see the module docstring).

    Example:
        >>> shape = ModelShape(layers=1, hidden=64, intermediate=256, heads=4, kv_heads=4, vocab=10)
        >>> activation_bytes(shape, 1, 1, "full"), activation_bytes(shape, 1, 1, "selective-op")
        (128.0, 1152.0)
    """
    full = tokens * model.hidden / tp * dtype_bytes
    if ac == "full":
        return float(full)
    none = block_activation_bytes(model, tokens, tp, dtype_bytes)
    if ac == "selective-op":
        kv = model.hidden * model.kv_heads // model.heads
        return float(min(none, tokens * (4 * model.hidden + kv + model.intermediate) / tp * dtype_bytes))
    if ac == "selective-layer":
        return (full + none) / 2
    return none


def head_bytes(model: ModelShape, tokens: float, tp: int) -> tuple[float, float]:
    """Elements of the last stage's logits (``t V / tp``) and what its head keeps for backward
    (the output projection's gathered input ``t h``, the final norm's input ``t h / tp``)."""
    return tokens * model.vocab / tp, tokens * model.hidden * (1 + 1 / tp)


def loss_peak_bytes(model: ModelShape, tokens: float, lay: ClusterLayout, runtime: Runtime) -> float:
    """Bytes the loss holds at its peak on the last stage (the logits unless the runtime keeps
    them as stage outputs, plus the loss's own copies; loss parallel's only under TP > 1)."""
    logits, _ = head_bytes(model, tokens, lay.tp)
    own = runtime.loss_parallel_bytes if lay.tp > 1 else runtime.loss_bytes
    held = 0 if runtime.keeps_outputs and lay.pp > 1 else runtime.logits_bytes
    return logits * (held + own)


def static_bytes(model: ModelShape, lay: ClusterLayout, layers_on_rank: int, first: bool, last: bool,
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
    shard_group = lay.dp * lay.cp
    if lay.fsdp:
        shard = params / (lay.tp * shard_group)
        held_blocks = layers_on_rank if lay.pp > 1 else min(2, layers_on_rank)
        unsharded = (held_blocks * model.layer_params + (params - layers_on_rank * model.layer_params)) / lay.tp
        grad_bytes = r.grad_accum_bytes if lay.pp > 1 else BF16
        out = {"parameters + grads + optimizer (sharded)": shard * (4 + 4 + extra),
               "unsharded parameters (bf16)": unsharded * BF16 if shard_group > 1 else 0.0,
               f"unsharded gradients ({'fp32' if grad_bytes == 4 else 'bf16'})":
                   unsharded * grad_bytes if shard_group > 1 else 0.0}
    else:
        local = params / lay.tp
        out = {"parameters (bf16, replicated)": local * BF16,
               f"gradient buffer ({'fp32' if r.grad_accum_bytes == 4 else 'bf16'})": local * r.grad_accum_bytes,
               "master weights + optimizer (sharded)": local / shard_group * (4 + extra)}
    if r.keeps_outputs and lay.pp > 1:
        t = lay.mb * seq_len / lay.cp
        logits, _ = head_bytes(model, t, lay.tp)
        boundary = (stages_on_rank - (1 if last else 0)) * t * model.hidden / lay.tp * BF16
        out["stage outputs kept until the step ends"] = lay.m * (boundary + (logits * r.logits_bytes if last else 0.0))
    return out


def unsharded_without_pp(model: ModelShape, lay: ClusterLayout, loss_bytes: float,
                         recompute_bytes: float) -> tuple[float, float, float]:
    """FSDP2 without PP: ``(unsharded parameter bytes, unsharded gradient bytes, workspace)``
    at the rank's peak, the larger of the loss's moment (``loss_bytes`` of workspace) and a
    block backward's (``recompute_bytes``: a recomputed block's activations); see the module
    docstring.

    Example:
        >>> shape = ModelShape(layers=4, hidden=64, intermediate=256, heads=4, kv_heads=4, vocab=1000)
        >>> lay = ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=1, ac="full")
        >>> p, g, w = unsharded_without_pp(shape, lay, loss_bytes=1e6, recompute_bytes=0.0)
        >>> g, w  # at the loss: no gradient yet
        (0.0, 1000000.0)
    """
    root = model.vocab * model.hidden * (1 if model.tied else 2) / lay.tp
    block = model.layer_params / lay.tp
    at_loss = ((root + block) * BF16, 0.0, loss_bytes)
    in_block = ((root + 2 * block) * BF16, (model.vocab * model.hidden / lay.tp + 2 * block) * BF16, recompute_bytes)
    return max(at_loss, in_block, key=sum)


def timeline_peak(timeline: Sequence[tuple[float, float, Action]], held: Sequence[float], workspace: Sequence[float],
                  grads: Mapping[int, float]) -> tuple[float, float]:
    """The most bytes one rank holds at once over its simulated step (``timeline``: its
    ``(start, end, action)``), counting each stage's ``held`` bytes per microbatch from its F
    until its backward ends (B, or W when split), ``workspace`` while a B or I runs, and
    ``grads[stage]`` from the stage's first B or W to its last; returns the peak and the
    gradient bytes alive at it.

    Example:
        >>> from pippy_split.schedule import Action
        >>> tl = [(0, 1, Action(0, "F", 0)), (1, 2, Action(0, "F", 1)), (2, 4, Action(0, "B", 0)),
        ...       (4, 6, Action(0, "B", 1))]
        >>> timeline_peak(tl, held=[10.0], workspace=[1.0], grads={0: 5.0})
        (26.0, 5.0)
    """
    F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
    split = any(a.kind is W for _, _, a in timeline)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    events: list[tuple[float, int, float, bool]] = []  # (time, 0 frees / 1 allocates, bytes, is a gradient)
    add = events.append
    for start, end, a in timeline:
        k, s = a.kind, a.stage
        if k is F:
            add((start, 1, held[s], False))
            continue
        if k is B or (k is W and split):
            add((end, 0, -held[s], False))
        if k is B or k is I:
            add((start, 1, workspace[s], False))
            add((end, 0, -workspace[s], False))
        if k is B or k is W:
            first.setdefault(s, start)
            last[s] = end
    for s, t in first.items():
        events += [(t, 1, grads.get(s, 0.0), True), (last[s], 0, -grads.get(s, 0.0), True)]
    events.sort(key=lambda e: (e[0], e[1]))
    now = g = peak = g_at = 0.0
    for _, _, delta, is_grad in events:
        now += delta
        g += delta if is_grad else 0.0
        if now > peak:
            peak, g_at = now, g
    return peak, g_at


def reserved_bytes(live_peak: float, largest_transient: float) -> float:
    """What the caching allocator holds at the step's peak: the live peak plus
    :data:`ALLOCATOR_SPLIT_FRACTION` of the largest transient (see the module docstring).

    Example:
        >>> reserved_bytes(60 * 2**30, 10 * 2**30) / 2**30
        62.0
    """
    return live_peak + ALLOCATOR_SPLIT_FRACTION * largest_transient
