"""Mixed precision: which dtype each edge carries when stages run under ``torch.autocast``.

Sits between the Pipe and the stages built with ``mixed_precision=``. Those stages come
from the split traced again under the same autocast (``Pipe.under_autocast``), where
every value's metadata is what the real ops computed under autocast (a matmul's bf16
output, an fp32 norm): its edge specs already say what crosses each cut, and are used as
they are. Only a pipe traced under another autocast (a model traced on the CPU whose
stages run on CUDA) has its stages run once under the stages' autocast on fake tensors,
in stage order, to learn them. Every rank works this out alike from the same Pipe, so
senders and receivers agree.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

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
    """``{id(edge): spec}`` for every edge of ``pipe`` under ``torch.autocast(device_type, dtype)``:
    the pipe's own specs where it was traced under that autocast (``pipe.autocast``), else
    learned from a run of its stages on fake tensors (see the module docstring).

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
    for info in pipe.stages:
        relax_dtype_checks(info.module)
    if pipe.autocast == (device_type, dtype):  # traced under this autocast: its values' dtypes are known
        cache[key] = {id(e): e.spec for e in pipe.edges}
        return cache[key]
    cache[key] = _fake_autocast_specs(pipe, dtype, device_type)
    return cache[key]


def _fake_autocast_specs(pipe: PipeView, dtype: torch.dtype, device_type: str) -> dict[int, TensorSpec]:
    """The edges' specs from one run of every stage under autocast on fake tensors, in stage order."""
    inputs, bindings = pipe.example_inputs()
    specs: dict[int, TensorSpec] = {id(e): e.spec for e in pipe.edges}
    for info in pipe.stages:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            args = [_fake_arg(src, inputs, specs, bindings) for src in info.inputs]
        state: dict[str, torch.Tensor] = {
            n: mode.from_tensor(t) for n, t in [*info.module.named_parameters(), *info.module.named_buffers()]}
        try:
            with mode, torch.autocast(device_type, dtype=dtype):
                outs = torch.func.functional_call(info.module, state, tuple(args))
        except Exception as e:
            traced = f"torch.autocast({pipe.autocast[0]!r})" if pipe.autocast else "no autocast"
            raise PipelineError(f"stage {info.index}: could not run under torch.autocast({device_type!r}, {dtype}) "
                                f"on fake tensors to learn its edges' dtypes ({type(e).__name__}: {e}); the split was "
                                f"traced under {traced}. What works: put the model's tensors on a {device_type!r} "
                                f"device (or meta) before pipeline(), so the split is traced under "
                                f"torch.autocast({device_type!r}) and its edges' dtypes are read off that "
                                f"trace") from e
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        for edge in pipe.edges:
            if edge.src_stage == info.index:
                out = outs[edge.src_output]
                specs[id(edge)] = replace(edge.spec, dtype=out.dtype)
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
