"""Stages that call the user's own modules (split → Pipe, while stage graphs are built).

The model is traced with every module's call signature preserved
(``torch.export(preserve_module_call_signature=...)``), so for each module call the
graph records which values went in and which came out. A module call that lies whole
inside one stage is then swapped back in: its ops in the stage graph become one
``call_module`` node that calls the user's module object, held by the stage module under
its original FQN. ``stage.module.get_submodule("layers.3") is model.layers[3]``, and its
own ``forward`` runs, so hooks fire and ``fully_shard``, ``parallelize_module``,
``torch.compile``, ``checkpoint_wrapper`` and PEFT adapters apply as to the model. A call
the cut enters stays as traced ops (the glue), as does everything outside module calls.

The ATen graph keeps what it owns: edges and their specs, shapes, costs and the cut
itself come from the whole traced graph before any swap.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch.export.graph_signature import ConstantArgument
from torch.utils import _pytree as pytree

from .calls import Call, CallTree

__all__ = ["called_module_names", "parent_of", "swap_in_module_calls", "outermost_calls", "call_inputs", "output_leaves", "signature_key",
           "same_value_outside"]

_NODE_ARGS = ("TensorArgument", "SymIntArgument", "SymFloatArgument", "SymBoolArgument")


def output_leaves(value: Any) -> list[Any]:
    """Graph helper: a module's output as the flat list its call signature numbers."""
    return pytree.tree_leaves(value)


def signature_key(call: Call, fqn: str) -> str:
    """The name of one call's preserved signature: the module's FQN, ``@k`` for the k-th repeat."""
    return fqn + ("@" + call.key.rsplit("@", 1)[1] if "@" in call.key else "")


def _raw_path(op: torch.fx.Node, key: str) -> str | None:
    entry = (op.meta.get("nn_module_stack") or {}).get(key)
    return None if entry is None else str(entry[0])


def swap_in_module_calls(gm: torch.fx.GraphModule, stage_ops: set[torch.fx.Node], env: dict,
                         all_ops: list[torch.fx.Node], tree: CallTree, signatures: dict[str, Any],
                         by_name: dict[str, torch.fx.Node], model: torch.nn.Module,
                         user_path: Any) -> list[str]:
    """Replace, in stage module ``gm``, each outermost module call lying whole in the stage
    (``stage_ops``) by a call of the user's module; returns the swapped FQNs. Where a call
    cannot be swapped (a value leaves it other than through its outputs, such as router logits
    an output hook records), the calls inside it are tried.

    ``env`` maps the whole graph's nodes to ``gm``'s, ``all_ops`` are the whole graph's
    call nodes (``tree`` their module calls), ``signatures`` the preserved call signatures
    by name, ``user_path`` turns an export module path into the user's FQN.
    """
    swapped: list[str] = []
    todo = outermost_calls(stage_ops, all_ops, tree, signatures, user_path)
    while todo:
        call, fqn, sig = todo.pop(0)
        if _swap(gm, env, [all_ops[i] for i in range(call.first, call.last + 1)], sig, by_name, model, fqn):
            swapped.append(fqn)
        else:
            inner = _with_signatures([tree.calls[k] for k in call.children], all_ops, tree, signatures, user_path)
            todo = sorted(todo + inner, key=lambda c: c[0].first)
    if swapped:
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return swapped


def outermost_calls(stage_ops: set[torch.fx.Node], all_ops: list[torch.fx.Node], tree: CallTree,
                    signatures: dict[str, Any], user_path: Any) -> list[tuple[Call, str, Any]]:
    """``(call, FQN, signature)`` of the outermost module calls whose ops all lie in
    ``stage_ops`` and whose signature export kept, in call order; inside a call without one
    (it took an object export cannot flatten, such as a cache), its own calls are looked at."""
    inside = [c for c in tree.calls.values() if all(all_ops[i] in stage_ops for i in range(c.first, c.last + 1))]
    keys = {c.key for c in inside}
    return _with_signatures([c for c in inside if c.parent not in keys], all_ops, tree, signatures, user_path)


def _with_signatures(calls: list[Call], all_ops: list[torch.fx.Node], tree: CallTree, signatures: dict[str, Any],
                     user_path: Any) -> list[tuple[Call, str, Any]]:
    """``(call, FQN, signature)`` of each of ``calls`` whose signature export kept, and of the
    outermost calls with one inside each of the others, in call order."""
    out: list[tuple[Call, str, Any]] = []
    todo = sorted(calls, key=lambda c: c.first)
    while todo:
        call = todo.pop(0)
        raw = _raw_path(all_ops[call.first], call.key)
        fqn = user_path(raw) if raw is not None else None
        sig = signatures.get(signature_key(call, fqn)) if fqn is not None else None
        if sig is not None and fqn is not None:
            out.append((call, fqn, sig))
        else:
            todo = sorted(todo + [tree.calls[k] for k in call.children], key=lambda c: c.first)
    return out


def call_inputs(stage_ops: set[torch.fx.Node], all_ops: list[torch.fx.Node], tree: CallTree,
                signatures: dict[str, Any], by_name: dict[str, torch.fx.Node], user_path: Any) -> list[torch.fx.Node]:
    """Values the swapped-in calls of a stage take that its traced ops never read (an argument
    the module accepts but did not use on the example, such as ``position_ids``): the stage
    must receive them too, so each module is called with its real arguments."""
    out: dict[torch.fx.Node, None] = {}
    for _, _, sig in outermost_calls(stage_ops, all_ops, tree, signatures, user_path):
        for arg in sig.inputs:
            node = by_name.get(arg.name) if type(arg).__name__ in _NODE_ARGS else None
            if node is not None and node not in stage_ops and node.op in ("placeholder", "call_function"):
                out.setdefault(node, None)
    return list(out)


def _value(arg: Any, env: dict, by_name: dict[str, torch.fx.Node]) -> tuple[bool, Any]:
    """(known, value in the stage graph) of one preserved input."""
    if isinstance(arg, ConstantArgument):
        return True, arg.value
    if type(arg).__name__ in _NODE_ARGS:
        node = by_name.get(arg.name)
        return (node in env, env.get(node)) if node is not None else (False, None)
    return False, None


def _swap(gm: torch.fx.GraphModule, env: dict, ops: list[torch.fx.Node], sig: Any,
          by_name: dict[str, torch.fx.Node], model: torch.nn.Module, fqn: str) -> bool:
    span = [env[op] for op in ops if op in env]
    if not span:
        return False
    span_set = set(span)
    flat_in = []
    for arg in sig.inputs:
        known, value = _value(arg, env, by_name)
        if not known or (isinstance(value, torch.fx.Node) and value in span_set):
            return False
        flat_in.append(value)
    outs: list[torch.fx.Node | None] = []
    for arg in sig.outputs:
        if isinstance(arg, ConstantArgument):
            outs.append(None)
            continue
        known, value = _value(arg, env, by_name)
        if not known or value not in span_set:
            return False
        outs.append(value)
    leaking = [n for n in span if n not in outs and any(u not in span_set for u in n.users)]
    same = _outside_values(leaking, ops, env)
    if any(src is None for src in same.values()):
        return False  # a value leaves the call other than through its outputs (a side channel)
    try:
        user_module = model.get_submodule(fqn)
    except AttributeError:
        return False
    _install_module(gm, fqn, user_module)
    args, kwargs = pytree.tree_unflatten(flat_in, sig.in_spec)
    graph = gm.graph
    with graph.inserting_before(span[0]):
        call = graph.call_module(fqn, tuple(args), dict(kwargs))
        if sig.out_spec.is_leaf():
            results: list[torch.fx.Node] = [call]
        else:
            leaves = graph.call_function(output_leaves, (call,))
            results = [graph.call_function(operator.getitem, (leaves, j)) for j in range(len(outs))]
    for arg, old, new in zip(sig.outputs, outs, results):
        if old is None:
            continue
        env[by_name[arg.name]] = new  # later swaps read the call's result, not the erased op
        new.meta = dict(old.meta)
        new.meta.pop("nn_module_stack", None)
        old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in span_set)
    if sig.out_spec.is_leaf():
        call.meta = dict(results[0].meta)
    for node, src in same.items():  # a no-op cast of an input, read outside: the input itself
        node.replace_all_uses_with(cast(torch.fx.Node, src), delete_user_cb=lambda u: u not in span_set)
    for node in reversed(span):
        graph.erase_node(node)
    return True


_NO_OP_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
                torch.ops.aten.alias.default)


def same_value_outside(node: torch.fx.Node, span: set[torch.fx.Node]) -> torch.fx.Node | None:
    """The value outside a call's ops that ``node`` is, where ``node`` is a chain of casts that
    change nothing (``x.to(torch.float32)`` of a float32 ``x``: eager returns ``x`` itself, so
    the model's code reads it after the call, as an RMSNorm's input read as the residual);
    None for any other value."""
    while node in span:
        src = node.args[0] if node.op == "call_function" and node.target in _NO_OP_CASTS and node.args else None
        if not isinstance(src, torch.fx.Node) or node.kwargs.get("copy") or not _same_tensor(node, src):
            return None
        node = src
    return node


def _outside_values(leaking: list[torch.fx.Node], ops: list[torch.fx.Node], env: dict) -> dict[torch.fx.Node, Any]:
    """For each stage node read after a call (``leaking``), the stage node of the value outside
    the call it is a no-op cast of, or None; judged on the whole graph (``ops``, the call's),
    whose nodes carry every value's metadata."""
    whole = {env[op]: op for op in ops if op in env}
    inside = set(ops)
    out: dict[torch.fx.Node, Any] = {}
    for node in leaking:
        src = same_value_outside(whole[node], inside) if node in whole else None
        out[node] = env.get(src) if src is not None else None
    return out


def _same_tensor(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.device == vb.device and [str(d) for d in va.shape] == [str(d) for d in vb.shape])


def parent_of(root: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    """``(module that holds fqn's last part, that part)`` inside ``root``, making plain
    containers along the way where the stage module has none yet."""
    *path, leaf = fqn.split(".")
    parent = root
    for part in path:
        child = parent._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            parent.add_module(part, child)
        parent = child
    return parent, leaf


def _install_module(root: torch.nn.Module, fqn: str, module: torch.nn.Module) -> None:
    """Put the user's ``module`` at ``fqn`` in the stage module, over the plain container
    that held its tensors (the same objects)."""
    parent, leaf = parent_of(root, fqn)
    parent._modules[leaf] = module


def called_module_names(gm: torch.nn.Module) -> set[str]:
    """FQNs of the user's modules a stage module calls (its ``call_module`` nodes) and of
    everything inside them: the modules whose own ``forward`` runs in the stage."""
    if not isinstance(gm, torch.fx.GraphModule):
        return set()
    names: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            target = str(node.target)
            names.add(target)
            names.update(f"{target}.{n}" for n, _ in gm.get_submodule(target).named_modules() if n)
    return names
