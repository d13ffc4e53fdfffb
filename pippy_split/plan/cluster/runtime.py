"""How a training job runs, as far as its memory and overlap depend on it: the few facts
about the training code (not the cluster, not the layout) that :mod:`.cluster_costs`
needs, stated per field, and the one preset the published checks use.

Sits beside :mod:`.cluster` (the hardware's numbers); :mod:`.cluster_costs` and
:mod:`.cluster_search` take one of these (``Runtime()`` when none is given).

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
    loss_bytes: int = 4
    """Bytes per logit element the loss holds at its peak besides the logits: 4 is
    cross-entropy's saved log-softmax output; a log-softmax over a vocabulary sharded by TP
    (torchtitan's loss parallel, ``torch.distributed.tensor.parallel.loss_parallel``) also
    materializes the shifted logits and their exponential, two more fp32 copies (12)."""
    keeps_outputs: bool = False
    """Whether the pipeline runtime keeps every microbatch's stage output until the step ends
    (``torch.distributed.pipelining`` before May 2025 appended each ``forward_one_chunk``
    output to ``output_chunks`` on every stage; on the last stage that is the fp32 logits of
    every microbatch). pippy_split does not."""
    float8_linears: bool = False
    """Whether the blocks' projections (q, k, v, o and the MLP's) run as Float8 matmuls, at
    the cluster's ``fp8_flops`` peak (torchao's ``Float8Linear``, as torchtitan's
    ``enable_float8_linear``); attention and the output projection stay in bf16."""

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
    "torchtitan-2412": Runtime(grad_accum_bytes=4, logits_bytes=4, loss_bytes=12, keeps_outputs=True),
}
"""torchtitan-2412: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
fp32 logits with loss parallel under TP, and torch's pipelining runtime of that month, which
kept each stage's outputs until the step ended (torch PR 153383 and issue 159251 changed
and discussed that in 2025). Float8 is per run (``with_(float8_linears=True)``: Tables 4-6)."""
