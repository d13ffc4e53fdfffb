"""How a training job runs, as far as its time and memory depend on it: the facts about
the training code (not the cluster, not the layout) that :mod:`.costs` needs, stated per
field, and the presets the published checks use.

Sits beside :mod:`.hardware` (the hardware's numbers); :mod:`.costs` and :mod:`.search`
take one of these (``Runtime()`` when none is given).

Example:
    >>> Runtime().grad_accum_bytes, Runtime.preset("torchtitan-2412").grad_accum_bytes
    (2, 4)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Runtime", "RUNTIMES"]


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """What the training code does that memory and time depend on."""

    grad_accum_bytes: int = 2
    """Bytes per element of a pipeline stage's unsharded gradients while they accumulate over
    the step's microbatches (FSDP2 under PP keeps them unsharded until the stage's last
    backward). 2: accumulated in the parameter dtype (bf16); 4: FSDP2 with
    ``reduce_dtype=float32``, which upcasts the accumulated gradient to fp32
    (``FSDPParam.to_accumulated_grad_if_needed``)."""
    logits_bytes: int = 4
    """Bytes per element of the logits the last stage hands to the loss (4: the model returns
    ``output(h).float()``, as torchtitan's Llama and most recipes do)."""
    loss_bytes: int = 8
    """Bytes per logit element the loss holds at its peak besides the logits, without TP:
    cross-entropy's saved log-softmax output and, in its backward, the gradient it writes
    (the logits themselves are freed before the backward: torchtitan's ``del pred``)."""
    loss_parallel_bytes: int = 12
    """The same under TP > 1, where the vocabulary is sharded and the log-softmax runs as
    ``torch.distributed.tensor.parallel.loss_parallel`` (torchtitan): the shifted logits and
    their exponential are two more fp32 copies. Charged only when ``tp > 1``."""
    keeps_outputs: bool = False
    """Whether the pipeline runtime keeps every microbatch's stage output until the step ends
    (``torch.distributed.pipelining`` before May 2025 appended each ``forward_one_chunk``
    output to ``output_chunks`` on every stage; on the last stage that is the fp32 logits of
    every microbatch). pippy_split does not."""
    float8_linears: bool = False
    """Whether the blocks' projections (q, k, v, o and the MLP's) run as Float8 matmuls (all
    three per linear: forward, input gradient, weight gradient), at the cluster's
    ``fp8_flops``; attention and the output projection stay in bf16."""
    float8_cast_bytes: float = 7.0
    """HBM bytes per element the Float8 recipe moves to scale and cast each matmul operand
    (torchao's dynamic tensorwise scaling: an amax pass reading bf16, a cast reading bf16 and
    writing fp8, and a transposed fp8 copy for the backward's matmuls: 2 + 3 + 2). A recipe
    that fuses the cast into the kernel before it (Transformer Engine) moves about 2."""
    fused_elementwise: bool = False
    """Whether the blocks' elementwise ops are fused (``torch.compile`` per block, or
    Transformer Engine's fused kernels): norms, rotary, SwiGLU and residual adds each read
    and write their tensors about once. Eager PyTorch runs each op as its own kernel, with
    fp32 round trips in RMSNorm and rotary (see :mod:`.block`)."""
    attention_kernel: str = "flash2"
    """The attention kernel: ``"flash2"`` (PyTorch's SDPA flash backend) or ``"cudnn"``
    (cuDNN's fused attention, as Transformer Engine runs it on Hopper)."""
    async_tp: bool = False
    """Whether TP's all-gathers and reduce-scatters are overlapped with the matmuls they feed
    (torchtitan's async TP, Megatron's TP communication overlap): each matmul is cut into
    ``tp`` chunks along its tokens and ``Kernels.overlap_fraction`` of the transfer hides
    behind them (one chunk's transfer always shows)."""
    grad_reduce_bytes: int = 2
    """Bytes per element data parallelism reduces gradients in (4: FSDP2 with
    ``reduce_dtype=float32``, as torchtitan runs)."""

    def with_(self, **changes: object) -> Runtime:
        """A copy with some fields changed, e.g. ``runtime.with_(float8_linears=True)``."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def preset(cls, name: str, **changes: object) -> Runtime:
        """A named runtime: ``"pippy_split"`` (the default) or ``"torchtitan-2412"``
        (torchtitan 9dec370 on torch 1963fc8, Dec 2024: the published Llama 3.1 tables).

        Example:
            >>> Runtime.preset("torchtitan-2412", float8_linears=True).float8_linears
            True
        """
        if name not in RUNTIMES:
            raise ValueError(f"unknown runtime preset {name!r}; known: {', '.join(RUNTIMES)}")
        return replace(RUNTIMES[name], **changes)  # type: ignore[arg-type]


RUNTIMES: dict[str, Runtime] = {
    "pippy_split": Runtime(),
    "torchtitan-2412": Runtime(grad_accum_bytes=4, logits_bytes=4, loss_bytes=8, loss_parallel_bytes=12,
                               keeps_outputs=True, grad_reduce_bytes=4),
    "nemo-2407": Runtime(grad_accum_bytes=4, logits_bytes=2, loss_bytes=4, loss_parallel_bytes=4,
                         float8_linears=True, float8_cast_bytes=2.0, fused_elementwise=True,
                         attention_kernel="cudnn", async_tp=True, grad_reduce_bytes=2),
}
"""torchtitan-2412: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
fp32 logits with loss parallel under TP, and torch's pipelining runtime of that month, which
kept each stage's outputs until the step ended (torch PR 153383 and issue 159251 changed
and discussed that in 2025). ``torch.compile`` (``fused_elementwise=True``), Float8 and async
TP are per run (``with_(...)``: the published tables say which).

nemo-2407: NeMo 24.07 on Megatron-core (the NeMo performance summary's DGX-H100 rows):
Transformer Engine's fused kernels, Float8 with the cast fused into the kernel before each
matmul, cuDNN fused attention, TP communication overlap, gradients accumulated in fp32
``main_grad`` buffers and reduced in bf16 with the distributed optimizer (a layout with
``fsdp=False``), bf16 logits into a fused vocabulary-parallel cross-entropy."""
