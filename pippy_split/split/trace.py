"""Trace a user's model into one exported graph (first step of split → Pipe).

The model is wrapped, not patched: a thin root module calls it and replaces
opaque objects in the output (an HF ``DynamicCache``, which export cannot
flatten) by ``None``, then ``torch.export`` traces the root, keeping the module
call signatures ``kept_calls.py`` chooses. What the exported program holds is
read once into :class:`Traced`: parameter and module names without the
wrapper's prefix, so every FQN below is the user's own
(``blocks.2.attn.qkv.weight``), the call's inputs and their checks, and what the
forward did in Python (``python_effects.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint_int
from torch.utils import _pytree as pytree

from .calls import ROOT_PREFIX, user_module_path
from .errors import TraceError
from .kept_calls import export_keeping_calls
from .opaque_values import fake_forward
from .python_effects import ForwardEffects, StateWrite, modules_kept_traced, watch_forward

__all__ = ["Traced", "trace_model", "ROOT_PREFIX", "user_module_path"]

_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, complex, type(None), torch.SymInt, torch.SymFloat)


class _TraceRoot(torch.nn.Module):
    """Calls the user's model and drops outputs export cannot flatten (caches)."""

    def __init__(self, mod: torch.nn.Module) -> None:
        super().__init__()
        self.mod = mod

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.mod(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        leaves = [leaf if isinstance(leaf, _PLAIN_LEAVES) else None for leaf in leaves]
        return pytree.tree_unflatten(leaves, spec)


def _root_for(model: torch.nn.Module) -> torch.nn.Module:
    """A _TraceRoot whose ``forward`` has the model's signature (so export names
    inputs after the model's arguments and ``dynamic_shapes`` keys still match)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return _TraceRoot(model)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _TraceRoot.forward(self, *args, **kwargs)

    forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])  # type: ignore[attr-defined]
    cls = type(f"TraceRoot_{type(model).__name__}", (_TraceRoot,), {"forward": forward})
    return cls(model)


def _strip(fqn: str) -> str:
    return fqn[len(ROOT_PREFIX):] if fqn.startswith(ROOT_PREFIX) else fqn


@dataclass
class Traced:
    """The exported graph plus the facts about its inputs the partitioner needs."""

    ep: ExportedProgram
    user_inputs: list[str]  # placeholder names of the model's inputs, flat order
    params: dict[str, str]  # placeholder name -> canonical FQN
    buffers: dict[str, str]  # placeholder name -> canonical FQN
    constants: dict[str, str]  # placeholder name -> lifted constant name
    non_persistent: set[str]  # buffer FQNs kept out of the state dict
    aliases: dict[str, list[str]]  # canonical FQN -> every FQN of that tensor (tied weights)
    signature: inspect.Signature | None
    example_arg_names: list[str]  # names the example passed positionally
    example_kwarg_names: list[str]
    example_n_varargs: int = 0  # values the example passed to the model's *args
    requires_grad_inputs: dict[str, bool] = field(default_factory=dict)
    # Per flat user input, what a call must match (``stage.model_io.input_check``): a tensor's
    # (dims, dtype), where a dim is None if dynamic, or a non-tensor's value (export baked it in).
    input_checks: list[Any] = field(default_factory=list)
    # The user's FQN (``@k`` for the k-th repeat of a call) -> export's ModuleCallSignature
    module_signatures: dict[str, Any] = field(default_factory=dict)
    # Modules a stage must not call as the user's object, each with a write that keeps it
    # traced (its subtree's Python state is set by a forward outside it: python_effects.py)
    kept_traced: dict[str, StateWrite] = field(default_factory=dict)
    # FQN of each module whose forward applies a custom torch.autograd.Function -> the Functions
    functions: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ..stage.model_io import ModelInputs  # local: stage/__init__ -> split/__init__ -> trace (a cycle at import)

        # ExportedProgram.call_spec builds a new NamedTuple class on every access: read it once.
        spec = self.ep.call_spec
        self.in_spec, self.out_spec = spec.in_spec, spec.out_spec
        # how a call becomes the flat inputs, checked against the trace; schedules keep it for their steps
        self.model_inputs = ModelInputs(self.signature, self.example_arg_names, self.example_kwarg_names,
                                        self.example_n_varargs, self.in_spec, self.user_inputs, self.input_checks)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.ep.graph

    @property
    def callable_signatures(self) -> dict[str, Any]:
        """The kept call signatures of the modules a stage may call as the user's objects
        (``module_signatures`` less the modules in ``kept_traced``)."""
        return {key: sig for key, sig in self.module_signatures.items()
                if key.split("@", 1)[0] not in self.kept_traced}

    def example_inputs(self) -> list[Any]:
        """Per flat user input as traced: a tensor's ``(shape, dtype)`` (dynamic sizes at
        their example value), or a non-tensor's value."""
        vals = {n.name: n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"}
        out: list[Any] = []
        for name in self.user_inputs:
            val = vals[name]
            if isinstance(val, torch.Tensor):
                out.append((tuple(hint_int(d) for d in val.shape), val.dtype))
            else:
                out.append(val if not isinstance(val, torch.SymInt) else hint_int(val))
        return out

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """A call's inputs as the flat list stages index into, each checked against the trace
        (:meth:`~pippy_split.stage.model_io.ModelInputs.flatten`)."""
        return self.model_inputs.flatten(args, kwargs)


def _example_names(sig: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[list[str], list[str]]:
    if sig is None:
        return [f"args[{i}]" for i in range(len(args))], list(kwargs)
    positional = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return positional[: len(args)], list(kwargs)


def _graph_inputs(ep: ExportedProgram) -> tuple[dict[str, str], dict[str, str], dict[str, str], set[str], list[str]]:
    """What each graph input is: ``(params, buffers, constants, non-persistent buffer FQNs,
    user inputs)``, placeholder names mapped to the user's own FQNs (wrapper prefix gone)."""
    params, buffers, constants, non_persistent = {}, {}, {}, set()
    user_inputs = []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = _strip(spec.target)
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = _strip(spec.target)
            if spec.persistent is False:
                non_persistent.add(_strip(spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
        else:
            raise TraceError(f"unsupported graph input kind {spec.kind} for {name!r}")
    return params, buffers, constants, non_persistent, user_inputs


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{fqn: every FQN of the same tensor}`` (tied weights share one list)."""
    by_id: dict[int, list[str]] = {}
    for fqn, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(fqn)
    return {fqn: names for names in by_id.values() for fqn in names}


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, strict: bool,
            cuts: Sequence[str] | None, keep_calls: bool = True) -> tuple[ExportedProgram, ForwardEffects]:
    """The model exported through its tracing root, with what its forward did in Python."""
    root = _root_for(model)
    try:
        if strict:  # TorchDynamo traces the bytecode: Python's effects are seen in an eager run only
            with watch_forward(model) as effects:
                fake_forward(model, args, kwargs)
            ep = export_keeping_calls(model, root, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict,
                                      effects=effects, cuts=cuts, keep_calls=keep_calls)
        else:
            with watch_forward(model) as effects:
                ep = export_keeping_calls(model, root, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict,
                                          effects=effects, cuts=cuts, keep_calls=keep_calls)
    except Exception as e:  # export raises many types; all mean "cannot trace"
        raise _trace_error(model, e, strict) from e
    return ep, effects


def _trace_error(model: torch.nn.Module, e: Exception, strict: bool) -> TraceError:
    """Export's reason, and what can help: the model's code made traceable (export failed with no
    module call signature kept, so the cause is in the model's forward), the other tracer, or
    stages built by hand (no trace at all). A cut, ``pipe_split()`` included, does not help: the
    whole model is traced before it is cut."""
    reason = f"{type(e).__name__}: {e}".strip()
    help_ = ["make the failing code traceable (the reason above names it)"]
    if "data-dependent" in reason or "DataDependent" in reason:
        help_[0] += ("; it branches on a tensor's values: torch._check(...) on that value, torch.cond, or "
                     "a Python number in place of the tensor")
    help_.append(f"strict={not strict} ({'TorchDynamo, which traces some Python the default cannot' if not strict else 'the default tracer, which runs the Python as written'})")
    help_.append("build the stages by hand with pippy_split.PipelineStage (no trace)")
    return TraceError(f"torch.export could not trace {type(model).__name__}:\n  {reason[:2000]}\n"
                      f"What can help: {'; or '.join(help_)}.")


def trace_model(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
    cuts: Sequence[str] | None = None,
    keep_calls: bool = True,
) -> Traced:
    """Export ``model`` on the example inputs; raise :class:`TraceError` with export's reason.

    ``cuts``: the module FQNs the split will cut at, where known before tracing; the trace
    then keeps only the call signatures the stages need (``kept_calls.calls_to_keep``:
    export's cost grows with them). None keeps every module's. ``keep_calls=False`` keeps none
    (one plain export: stages of traced ops only, as generation's decode step runs them).

    Example:
        >>> traced = trace_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
        >>> sorted(traced.module_signatures), sorted(traced.params.values())
        (['0', '1'], ['0.bias', '0.weight'])
    """
    from ..stage.model_io import input_check  # local, as ModelInputs above: a cycle through stage/__init__ at import

    args, kwargs = tuple(args), dict(kwargs or {})
    ep, effects = _export(model, args, kwargs, dynamic_shapes, strict, cuts, keep_calls)
    params, buffers, constants, non_persistent, user_inputs = _graph_inputs(ep)
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        sig = None
    arg_names, kwarg_names = _example_names(sig, args, kwargs)
    flat_examples = pytree.tree_leaves((args, kwargs))
    placeholder_vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    return Traced(
        ep=ep,
        module_signatures={_strip(entry.fqn): entry.signature for entry in ep.module_call_graph
                           if entry.signature is not None and entry.fqn.startswith(ROOT_PREFIX)},
        kept_traced=modules_kept_traced(effects.writes),
        functions=dict(effects.functions),
        user_inputs=user_inputs,
        params=params,
        buffers=buffers,
        constants=constants,
        non_persistent=non_persistent,
        aliases=_aliases(model),
        signature=sig,
        example_arg_names=arg_names,
        example_kwarg_names=kwarg_names,
        example_n_varargs=len(args) - len(arg_names),
        requires_grad_inputs={name: isinstance(x, torch.Tensor) and x.requires_grad
                              for name, x in zip(user_inputs, flat_examples)},
        input_checks=[input_check(placeholder_vals.get(name), x) for name, x in zip(user_inputs, flat_examples)],
    )
