"""Model zoo: small, deterministic reference models with everything needed to pipeline them.

Where this sits: outside the flow split → Pipe → stage → schedule → runtime. The zoo
feeds that flow. Tests, tutorials, benchmarks and `pippy-split train` take a
`ZooEntry` (a model plus example inputs, a split spec, a loss and a target) and
push it through `ps.pipeline(...)`.

Every model is a plain `nn.Module` that imports nothing from pippy_split, traces
with `torch.export.export(model, args, kwargs, strict=False)`, and runs forward plus
backward in a few milliseconds on CPU at the default sizes. Each factory takes
`seed=0` and size keywords. It builds the model and the example tensors under
that seed, so two calls with the same arguments give identical weights and inputs.

    from pippy_split import zoo
    entry = zoo.get("tiny_gpt", n_layer=8)
    out = entry.model(*entry.args, **entry.kwargs)
    loss = entry.loss_fn(out, entry.target)

Registry (name: split spec, stages, what it exercises):

    tiny_gpt           ["blocks.1", "blocks.2", "blocks.3"]  4  causal char-level GPT
    tied_lm            ["blocks.2"]                          2  head.weight IS tok_emb.weight
    tiny_llama         ["layers.1", "layers.2", "layers.3"]  4  complex rotary table, int positions
    tiny_unet          ["down2", "up2", "up1"]               4  cross-stage skips, fan-out of stem
    mlp_stack          ["layers.2", "layers.4", "layers.6"]  4  plain chain
    fan_out_skip       ["mid", "tail"]                       3  minimal fan-out skip
    out_of_order_args  ["mix"]                               2  graph reads b before a
    kwargs_buffers     ["body", "head"]                      3  buffers, float + bool kwargs
    input_read_late    ["mid", "out"]                        3  input read only by stage 1
"""

from __future__ import annotations

from typing import Any, Callable

from .entry import ZooEntry, layer_split
from .gpt import tied_lm, tiny_gpt
from .llama import tiny_llama
from .misc import input_read_late, kwargs_buffers, out_of_order_args
from .mlp import fan_out_skip, mlp_stack
from .unet import tiny_unet

__all__ = ["ZOO", "ZooEntry", "get", "layer_split"]

ZOO: dict[str, Callable[..., ZooEntry]] = {
    "tiny_gpt": tiny_gpt,
    "tied_lm": tied_lm,
    "tiny_llama": tiny_llama,
    "tiny_unet": tiny_unet,
    "mlp_stack": mlp_stack,
    "fan_out_skip": fan_out_skip,
    "out_of_order_args": out_of_order_args,
    "kwargs_buffers": kwargs_buffers,
    "input_read_late": input_read_late,
}
"""Registry: name -> factory. Every factory takes ``seed=0`` and size keywords."""


def get(name: str, **kw: Any) -> ZooEntry:
    """Build a registered zoo entry.

    Args:
        name: a key of `ZOO`, e.g. ``"tiny_gpt"``.
        **kw: passed to the factory (``seed=``, sizes such as ``n_layer=``).

    Returns:
        A fresh `ZooEntry`; the same name and keywords always give identical weights.

    Example:
        >>> entry = get("mlp_stack", d=16)
        >>> entry.num_stages
        4
    """
    try:
        factory = ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; available: {', '.join(ZOO)}") from None
    return factory(**kw)
