"""Trace a user's model into one exported graph (first step of split → Pipe).

The model is wrapped, not patched: a thin root module calls it and replaces
opaque objects in the output (an HF ``DynamicCache``, which export cannot
flatten) by ``None``, then ``torch.export`` traces the root. Parameter and
module names are reported without the wrapper's prefix, so every FQN below is
the user's own (``blocks.2.attn.qkv.weight``).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, cast

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint_int
from torch.utils import _pytree as pytree

from .errors import TraceError
from .python_effects import ForwardEffects, StateWrite, modules_kept_traced, watch_forward

__all__ = ["Traced", "trace_model", "ROOT_PREFIX", "user_module_path"]

ROOT_PREFIX = "mod."
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


def user_module_path(path: str) -> str | None:
    """The user's FQN for a module path of export's ``nn_module_stack`` (``"mod.blocks.0"``
    -> ``"blocks.0"``), or ``None`` for the model itself and the tracing wrapper. Only this
    module knows the wrapper's name.

    Example:
        >>> user_module_path("mod.blocks.0"), user_module_path("mod")
        ('blocks.0', None)
    """
    if path.startswith(ROOT_PREFIX):
        return path[len(ROOT_PREFIX):]
    return None if path in ("", ROOT_PREFIX.rstrip(".")) else path


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
        from ..stage.model_io import ModelInputs  # the one home of the call's checks, which steps keep

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


def _export_keeping_calls(model: torch.nn.Module, root: torch.nn.Module, args: tuple, kwargs: dict,
                          dynamic_shapes: Any, strict: bool, effects: ForwardEffects,
                          keep_calls: Sequence[str] | None = None) -> ExportedProgram:
    """Export with every module's call signature kept (so stages can call the user's
    modules), except modules whose arguments or results export cannot flatten (an HF
    ``DynamicCache``): those stay traced ops. Where a signature cannot be kept safely, the
    signatures outside the modules that apply a custom autograd Function (``effects``,
    filled by the first export), or the plain export, with a warning that names what no
    longer applies to the modules."""

    def export(preserve: tuple[str, ...]) -> ExportedProgram:
        # No source line per node: recording them is about a third of export's time, and
        # nothing downstream reads them (the stages' code just loses its "# File:" comments).
        with _no_stack_traces():
            return torch.export.export(root, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict,
                                       preserve_module_call_signature=preserve)

    names = list(keep_calls) if keep_calls is not None else [name for name, _ in model.named_modules() if name]
    try:
        ep = export(tuple(ROOT_PREFIX + n for n in names))
    except Exception:  # a module taking or giving an object export cannot flatten
        opaque = _modules_with_opaque_values(model, args, kwargs)
        try:
            ep = export(tuple(ROOT_PREFIX + n for n in names if n not in opaque))
        except Exception as e:
            return _plain_export(model, export, f"{type(e).__name__}: {str(e).strip()[:300]}")
    if any(n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator) for n in ep.graph.nodes):
        # Kept signatures next to a torch.no_grad()/autocast region can change which values
        # cross it; keep them only where the graph is the plain one.
        plain = export(())
        if not _same_graph(ep.graph_module, plain.graph_module):
            # A Function's forward runs in no-grad mode: keep no signature inside it.
            inside = [n for n in names if any(n.startswith(f + ".") for f in effects.functions)]
            if inside:
                kept = export(tuple(ROOT_PREFIX + n for n in names if n not in inside))
                if _same_graph(kept.graph_module, plain.graph_module):
                    return kept
            return _plain_export(model, lambda _: plain, "keeping them changes the graph around a higher-order "
                                 "region (torch.no_grad() or autocast inside forward)")
    return ep


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """``torch.fx.config.do_not_emit_stack_traces`` on, then back as it was (a plain module, no ``patch``)."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _plain_export(model: torch.nn.Module, export: Any, reason: str) -> ExportedProgram:
    warnings.warn(f"{type(model).__name__}: torch.export could not keep its modules' call signatures ({reason}); "
                  "its stages run the traced ops only, so hooks, fully_shard per block, parallelize_module and other "
                  "module wrappers applied to a stage's submodules do not take effect", stacklevel=4)
    return export(())


def _modules_with_opaque_values(model: torch.nn.Module, args: tuple, kwargs: dict) -> set[str]:
    """Modules that take or return a value export cannot flatten into tensors and scalars,
    found by one forward on fake tensors (no compute, no memory)."""
    plain = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)
    opaque: set[str] = set()
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def pre(m: Any, a: Any, kw: Any, _n: str = name) -> None:
            if not all(isinstance(leaf, plain) for leaf in pytree.tree_leaves((a, kw))):
                opaque.add(_n)

        def post(m: Any, a: Any, kw: Any, out: Any, _n: str = name) -> None:
            if not all(isinstance(leaf, plain) for leaf in pytree.tree_leaves(out)):
                opaque.add(_n)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        _fake_forward(model, args, kwargs)
    finally:
        for h in handles:
            h.remove()
    return opaque


def calls_to_keep(model: torch.nn.Module, split_fqns: Sequence[str], called: set[str] | None = None) -> list[str]:
    """The modules whose call signatures a trace must keep so that, with cuts at the modules
    ``split_fqns``, every stage can call each user's module that lies whole in it: going down
    from the root through every module a cut enters (the split points' ancestors) or that is
    not called as a whole, the first module called whole, and nothing inside it (that runs in
    its own ``forward``). ``called``: the FQNs a forward called (None: every module whose
    class has a ``forward``, so a ``ModuleList`` is passed through). Keeping fewer signatures
    makes ``torch.export`` cheaper.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
        >>> calls_to_keep(model, ["1.1"]), calls_to_keep(model, ["1"]), calls_to_keep(model, ["1"], called={"0", "1.1"})
        (['0', '1.0', '1.1'], ['0', '1'], ['0', '1.1'])
    """
    entered = {""}
    for fqn in split_fqns:
        parts = fqn.split(".")
        entered.update(".".join(parts[:k]) for k in range(1, len(parts)))
    keep: list[str] = []

    def descend(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            runs = fqn in called if called is not None else type(child).forward is not torch.nn.Module.forward
            if runs and fqn not in entered:
                keep.append(fqn)
            else:
                descend(fqn + ".", child)

    descend("", model)
    return keep


def _ran_modules(ep: ExportedProgram) -> set[str]:
    """The user's modules whose calls left ops in the exported graph."""
    ran: set[str] = set()
    for node in ep.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            fqn = user_module_path(path)
            if fqn:
                ran.add(fqn)
    return ran


def _export_for_cuts(model: torch.nn.Module, root: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                     strict: bool, effects: ForwardEffects, cuts: Sequence[str] | None) -> ExportedProgram:
    """Export keeping every module's call signature (``cuts`` None), or only those that cuts
    at ``cuts`` need (:func:`calls_to_keep`); where the forward did not call a module the
    class-based guess took as called (a container its parent iterates over), the children it
    calls are kept too and the model exported again."""
    if cuts is None:
        return _export_keeping_calls(model, root, args, kwargs, dynamic_shapes, strict, effects)
    keep = calls_to_keep(model, cuts)
    ep = _export_keeping_calls(model, root, args, kwargs, dynamic_shapes, strict, effects, keep)
    more = set(calls_to_keep(model, cuts, _ran_modules(ep))) - set(keep)
    if more:
        ep = _export_keeping_calls(model, root, args, kwargs, dynamic_shapes, strict, effects, keep + sorted(more))
    return ep


def _fake_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """One forward of ``model`` on fake tensors (no compute, no memory), for the probes that
    watch it; an exception ends it quietly (a probe only narrows what is kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            model(*fake[0], **fake[1])
    except Exception:
        pass


def _same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """Whether two graphs run the same ops on the same values (names aside), subgraphs of
    higher-order ops included."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    if len(na) != len(nb):
        return False
    index_a = {n: i for i, n in enumerate(na)}
    index_b = {n: i for i, n in enumerate(nb)}
    for x, y in zip(na, nb):
        if x.op != y.op:
            return False
        if x.op == "get_attr":
            sx, sy = getattr(a, str(x.target), None), getattr(b, str(y.target), None)
            if isinstance(sx, torch.fx.GraphModule) != isinstance(sy, torch.fx.GraphModule):
                return False
            if isinstance(sx, torch.fx.GraphModule) and not _same_graph(sx, cast(torch.fx.GraphModule, sy)):
                return False
        elif x.op != "placeholder" and x.target != y.target:
            return False
        ax = pytree.tree_map_only(torch.fx.Node, lambda n: ("node", index_a[n]), (x.args, x.kwargs))
        ay = pytree.tree_map_only(torch.fx.Node, lambda n: ("node", index_b[n]), (y.args, y.kwargs))
        if str(ax) != str(ay):
            return False
    return True


def trace_model(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
    cuts: Sequence[str] | None = None,
) -> Traced:
    """Export ``model`` on the example inputs; raise :class:`TraceError` with export's reason.

    ``cuts``: the module FQNs the split will cut at, where known before tracing; the trace
    then keeps only the call signatures the stages need (:func:`calls_to_keep`: export's
    cost grows with them). None keeps every module's."""
    from ..stage.model_io import input_check  # what a call must match; checked where steps run it

    kwargs = dict(kwargs or {})
    root = _root_for(model)
    try:
        if strict:  # TorchDynamo traces the bytecode: Python's effects are seen in an eager run only
            with watch_forward(model) as effects:
                _fake_forward(model, tuple(args), kwargs)
            ep = _export_for_cuts(model, root, tuple(args), kwargs, dynamic_shapes, strict, effects, cuts)
        else:
            with watch_forward(model) as effects:
                ep = _export_for_cuts(model, root, tuple(args), kwargs, dynamic_shapes, strict, effects, cuts)
    except Exception as e:  # export raises many types; all mean "cannot trace"
        reason = f"{type(e).__name__}: {e}"
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}:\n  {reason.strip()[:2000]}\n"
            "What to do: make the failing code traceable (see the reason above), try "
            "strict=False/True, mark the stage boundaries with pippy_split.pipe_split() and trace "
            "the parts that work, or build the stages by hand with pippy_split.PipelineStage."
        ) from e

    params, buffers, constants, non_persistent, user_inputs = _graph_inputs(ep)
    aliases = _aliases(model)
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        sig = None
    arg_names, kwarg_names = _example_names(sig, tuple(args), kwargs)
    n_varargs = len(args) - len(arg_names)
    flat_examples = pytree.tree_leaves((tuple(args), kwargs))
    rg = {name: isinstance(x, torch.Tensor) and x.requires_grad for name, x in zip(user_inputs, flat_examples)}
    placeholder_vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    checks = [input_check(placeholder_vals.get(name), x) for name, x in zip(user_inputs, flat_examples)]
    signatures = {_strip(entry.fqn): entry.signature for entry in ep.module_call_graph
                  if entry.signature is not None and entry.fqn.startswith(ROOT_PREFIX)}
    return Traced(
        ep=ep,
        module_signatures=signatures,
        kept_traced=modules_kept_traced(effects.writes),
        functions=dict(effects.functions),
        user_inputs=user_inputs,
        params=params,
        buffers=buffers,
        constants=constants,
        non_persistent=non_persistent,
        aliases=aliases,
        signature=sig,
        example_arg_names=arg_names,
        example_kwarg_names=kwarg_names,
        example_n_varargs=n_varargs,
        requires_grad_inputs=rg,
        input_checks=checks,
    )
