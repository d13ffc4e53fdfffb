"""Mixed precision: which dtype each edge carries when stages run under ``torch.autocast``.

Sits between the Pipe (whose edge specs were traced in the model's own precision) and the
stages built with ``mixed_precision=``: every stage is run once under autocast on fake
tensors (no compute, no memory), in stage order, so the specs of the edges it sends say
the dtype autocast really produces there (a matmul's bf16 output, an fp32 norm). Every
rank works this out alike from the same Pipe, so senders and receivers agree.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..split.spec import InputKind, StageInput, TensorSpec
from .errors import PipelineError

if TYPE_CHECKING:
    from .pipe_view import PipeView

__all__ = ["check_mixed_precision", "autocast_edge_specs", "relax_dtype_checks"]

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def check_mixed_precision(dtype: Any, where: str) -> None:
    """Refuse anything but ``None``, ``torch.bfloat16`` or ``torch.float16``."""
    if dtype is not None and dtype not in _AUTOCAST_DTYPES:
        raise ValueError(f"{where}: mixed_precision={dtype!r} is not an autocast dtype; use torch.bfloat16 or "
                         "torch.float16 (or None for the model's own precision)")


def autocast_edge_specs(pipe: PipeView, dtype: torch.dtype, device_type: str) -> dict[int, TensorSpec]:
    """``{id(edge): spec}`` for every edge of ``pipe`` under ``torch.autocast(device_type, dtype)``.

    Example:
        >>> import pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> pipe = ps.pipeline(model, ["1"], (torch.randn(2, 4),))
        >>> specs = autocast_edge_specs(pipe, torch.bfloat16, "cpu")
        >>> [(pipe.edges[0].spec.dtype, specs[id(pipe.edges[0])].dtype)]  # a matmul's output under autocast
        [(torch.float32, torch.bfloat16)]
    """
    cache = pipe.derived.setdefault("autocast_specs", {})
    key = (dtype, device_type)
    if key in cache:
        return cache[key]
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs, bindings = pipe.example_inputs()
    specs: dict[int, TensorSpec] = {id(e): e.spec for e in pipe.edges}
    for info in pipe.stages:
        relax_dtype_checks(info.module)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            args = [_fake_arg(src, inputs, specs, bindings) for src in info.inputs]
        state: dict[str, torch.Tensor] = {
            n: mode.from_tensor(t) for n, t in [*info.module.named_parameters(), *info.module.named_buffers()]}
        try:
            with mode, torch.autocast(device_type, dtype=dtype):
                outs = torch.func.functional_call(info.module, state, tuple(args))
        except Exception as e:
            raise PipelineError(f"stage {info.index}: could not run under torch.autocast({device_type!r}, {dtype}) "
                                f"to learn its edges' dtypes ({type(e).__name__}: {e})") from e
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        for edge in pipe.edges:
            if edge.src_stage == info.index:
                out = outs[edge.src_output]
                specs[id(edge)] = replace(edge.spec, dtype=out.dtype)
    cache[key] = specs
    return specs


def relax_dtype_checks(module: torch.nn.Module) -> None:
    """Drop export's dtype assertions (``aten._assert_tensor_metadata``) from a traced stage:
    they pin each checked value to its traced dtype, which autocast changes on purpose
    (a ``.to(torch.float32)`` after them still converts). Shapes are checked by the runtime."""
    if not isinstance(module, torch.fx.GraphModule):
        return
    target = torch.ops.aten._assert_tensor_metadata.default
    asserts = [n for n in module.graph.nodes if n.op == "call_function" and n.target is target]
    for node in asserts:
        module.graph.erase_node(node)
    if asserts:
        module.recompile()


def _fake_arg(src: StageInput, inputs: list[Any], specs: dict[int, TensorSpec], bindings: dict) -> Any:
    if src.kind is InputKind.MODEL:
        value = inputs[src.model_input]
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
            return torch.empty(value[0], dtype=value[1])
        return value
    if src.kind is InputKind.SYMBOL:
        return int(src.expr.xreplace(bindings))
    spec = specs[id(src.edge)]
    shape = spec.concrete_shape(bindings) if spec.is_dynamic else spec.shape
    return torch.empty(shape, dtype=spec.dtype).requires_grad_(spec.carries_grad)
