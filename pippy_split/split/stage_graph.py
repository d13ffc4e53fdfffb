"""Build each stage's module and the edge list from a partition plan.

Third step of split → Pipe. For every stage: a ``torch.fx.GraphModule`` whose
parameters and buffers sit at the model's own FQNs, whose inputs are the model
inputs it reads (model order), then the values it receives (in the order it first
uses them), then the symbolic sizes it needs, and whose outputs are the values
later stages read.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, cast

import sympy
import torch
from torch.export.graph_signature import TensorArgument
from torch.fx import GraphModule

from .calls import call_stack, call_tree
from .cost import mutated_args, node_flops
from .errors import SplitError
from .grad import infer_requires_grad
from .markers import is_split_marker
from .module_calls import call_inputs, parent_of, signature_key, swap_in_module_calls
from .partition import Partition, module_paths
from .spec import MODEL_INPUT, Edge, InputKind, StageInput, SymbolSource, TensorSpec
from .symbols import spec_of, symbol_sources, user_symbol_names
from .trace import Traced, user_module_path

__all__ = ["StageInfo", "Built", "build_stages"]


@dataclass
class StageInfo:
    """One stage: its module and how its inputs and outputs connect."""

    index: int
    module: GraphModule
    inputs: list[StageInput]  # one per positional input of the module, in order
    output_names: list[str]
    output_specs: list[TensorSpec | None]
    modules: list[str]  # top-level module FQNs it runs, in order
    flops: int = 0
    param_fqns: list[str] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


@dataclass
class Built:
    stages: list[StageInfo]
    edges: list[Edge]
    symbols: list[SymbolSource]
    output_leaves: list[tuple[str, Any]]  # ("stage", out_index) in last stage, or ("const", value)
    shared_parameters: dict[str, list[tuple[int, list[str]]]]


def _install(root: torch.nn.Module, fqn: str, value: torch.Tensor, *, buffer: bool, persistent: bool = True) -> None:
    mod, leaf = parent_of(root, fqn)
    if buffer:
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        mod.register_parameter(leaf, cast(torch.nn.Parameter, value))


class _Builder:
    def __init__(self, traced: Traced, plan: Partition, model: torch.nn.Module) -> None:
        self.traced, self.plan, self.model = traced, plan, model
        self.graph = traced.graph
        self.placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        self.input_index = {name: i for i, name in enumerate(traced.user_inputs)}
        seed = {name: p.requires_grad for name, p in self._param_tensors().items()}
        seed.update(traced.requires_grad_inputs)
        self.rg = infer_requires_grad(self.graph, seed, traced.functions)
        raw_symbols = symbol_sources(traced, self.placeholders)
        self.known_symbols = {s.symbol for s in raw_symbols}  # export's own symbols
        self.rename = user_symbol_names(self.placeholders)  # shown and bound under the user's Dim names
        self.symbols = [SymbolSource(self.rename.get(s.symbol, s.symbol), s.input_index, s.dim, s.lower, s.upper)
                        for s in raw_symbols]
        self.position = {n: i for i, n in enumerate(self.graph.nodes)}
        self.n = plan.num_stages
        self.last = self.n - 1
        out_node = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        self.output_leaves = list(out_node.args[0])
        self.calls = call_tree(plan.ops)  # module calls, for swapping the user's modules into stages
        self.by_name = {n.name: n for n in self.graph.nodes}
        self.returned = {key: {o.name for o in sig.outputs if isinstance(o, TensorArgument)}
                         for key, sig in traced.module_signatures.items()}  # values each module call returns

    def _param_tensors(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        state.update(dict(self.model.named_buffers(remove_duplicate=False)))
        out: dict[str, torch.Tensor] = {}
        for name, fqn in {**self.traced.params, **self.traced.buffers}.items():
            out[name] = state[fqn]
        return out

    def stage_of(self, node: torch.fx.Node) -> int | None:
        return self.plan.stage_of.get(node)

    def label(self, v: torch.fx.Node) -> str:
        """What a value crossing a cut is, in the model's terms (``Edge.label``): the outermost
        module call returning it (``blocks.1``; ``layer@2`` for a module's third call), else
        ``add_14 in blocks.1.attn`` inside a module, else its graph name."""
        inside = ""
        for key, path in zip(call_stack(v), module_paths(v)):
            call = self.calls.calls.get(key)
            name = signature_key(call, path) if call is not None else path
            if v.name in self.returned.get(name, ()):
                return name
            inside = path
        return f"{v.name} in {inside}" if inside else v.name

    def build(self) -> Built:
        stage_ops: list[list[torch.fx.Node]] = [[] for _ in range(self.n)]
        for op in self.plan.ops:
            if not is_split_marker(op.target):
                stage_ops[self.plan.stage_of[op]].append(op)
        # Values each stage reads from outside itself, in first-use order.
        reads: list[list[torch.fx.Node]] = []
        for s, ops in enumerate(stage_ops):
            seen: dict[torch.fx.Node, None] = {}
            for op in ops:
                for a in op.all_input_nodes:
                    if a.op == "placeholder" or (a.op == "call_function" and self.stage_of(a) != s):
                        seen.setdefault(a, None)
            if s == self.last:
                for leaf in self.output_leaves:
                    if isinstance(leaf, torch.fx.Node) and self.stage_of(leaf) != s:
                        seen.setdefault(leaf, None)
            for a in call_inputs(set(ops), self.plan.ops, self.calls, self.traced.callable_signatures, self.by_name,
                                 user_module_path):
                seen.setdefault(a, None)
            reads.append(list(seen))
        # Producer side: which values leave each stage.
        consumers: dict[torch.fx.Node, set[int]] = {}
        for s, values in enumerate(reads):
            for v in values:
                if v.op == "call_function" and not isinstance(v.meta.get("val"), torch.SymInt):
                    consumers.setdefault(v, set()).add(s)
        outputs: list[list[torch.fx.Node]] = [[] for _ in range(self.n)]
        for v in sorted(consumers, key=self.position.__getitem__):
            outputs[cast(int, self.stage_of(v))].append(v)  # a call_function: it has a stage
        last_out: dict[torch.fx.Node, int] = {}
        for leaf in self.output_leaves:
            if isinstance(leaf, torch.fx.Node) and leaf not in last_out:
                last_out[leaf] = len(last_out)
        outputs[self.last] = list(last_out)
        out_index = [{v: i for i, v in enumerate(outs)} for outs in outputs]

        edges: list[Edge] = []
        stages: list[StageInfo] = []
        installed: dict[str, list[tuple[int, list[str]]]] = {}
        for s in range(self.n):
            info, stage_edges = self._build_stage(s, stage_ops[s], reads[s], outputs[s], out_index, installed)
            stages.append(info)
            edges.extend(stage_edges)
        self._place_unused(stages, installed)
        _name_module_ranges(stages)
        leaves = [("stage", last_out[x]) if isinstance(x, torch.fx.Node) else ("const", x) for x in self.output_leaves]
        # Only parameters: a buffer has no gradient to sum.
        params = {self._key(fqn) for fqn in self.traced.params.values()}
        shared = {k: v for k, v in installed.items() if len(v) > 1 and k in params}
        return Built(stages, edges, self.symbols, leaves, shared)

    def _key(self, fqn: str) -> str:
        """One name per tensor: export may give each alias of a tied tensor its own
        graph input, so tensors are keyed by their first FQN in the model."""
        return self.traced.aliases.get(fqn, [fqn])[0]

    def _aliases_for(self, canonical: str, users: list[torch.fx.Node]) -> list[str]:
        names = self.traced.aliases.get(canonical, [canonical])
        if len(names) == 1:
            return names
        user_paths = {p for u in users for p in module_paths(u)} | {""}
        chosen = [n for n in names if (n.rsplit(".", 1)[0] if "." in n else "") in user_paths]
        return chosen or [canonical]

    def _build_stage(self, s: int, ops: list[torch.fx.Node], reads: list[torch.fx.Node], outs: list[torch.fx.Node],
                     out_index: list[dict[torch.fx.Node, int]], installed: dict[str, list[tuple[int, list[str]]]]
                     ) -> tuple[StageInfo, list[Edge]]:
        """Stage ``s``'s GraphModule and StageInfo from its ops, the values it reads and the
        values it outputs; ``installed`` collects which stages hold each tensor."""
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}
        sources, edges = self._inputs(s, g, env, reads, out_index)
        mutated = {a for op in ops for a in mutated_args(op)}
        for v in list(env):
            if v in mutated and isinstance(env[v], torch.fx.Node):
                # Received values are autograd leaves: an in-place op on them would fail.
                env[v] = g.call_function(torch.ops.aten.clone.default, (env[v],))
        root = torch.nn.Module()
        attrs = [v for v in reads if v.op == "placeholder" and v.name not in self.input_index]
        param_fqns, installs = self._attributes(s, g, env, root, attrs, set(ops), installed)
        modules, flops = self._copy_ops(g, env, root, ops)
        g.output(tuple(env[v] for v in outs))
        module = self._module(s, root, g, installs)
        for fqn in swap_in_module_calls(module, set(ops), env, self.plan.ops, self.calls, self.traced.callable_signatures,
                                        self.by_name, self.model, user_module_path):
            # the user's module brings all its tensors, also those the trace never read
            sub = module.get_submodule(fqn)
            for name in [n for n, _ in sub.named_parameters(remove_duplicate=False)] + [
                    n for n, _ in sub.named_buffers(remove_duplicate=False)]:
                if f"{fqn}.{name}" not in param_fqns:
                    param_fqns.append(f"{fqn}.{name}")
        out_specs = [
            spec_of(v, self.rg[v], self.known_symbols, self.rename) if isinstance(v.meta.get("val"), torch.Tensor) else None
            for v in outs
        ]
        info = StageInfo(s, module, sources, [v.name for v in outs], out_specs, modules, flops, param_fqns)
        return info, edges

    def _inputs(self, s: int, g: torch.fx.Graph, env: dict, reads: list, out_index: list[dict[torch.fx.Node, int]]
                ) -> tuple[list[StageInput], list[Edge]]:
        """Placeholders for what stage ``s`` reads from outside: model inputs, values of
        earlier stages (one Edge each, from the true producer), dynamic sizes."""
        sources: list[StageInput] = []
        edges: list[Edge] = []
        user_in = sorted((v for v in reads if v.name in self.input_index), key=lambda v: self.input_index[v.name])
        received = [v for v in reads if v.op == "call_function" and not isinstance(v.meta.get("val"), torch.SymInt)]
        symbolic = [v for v in reads if v.op == "call_function" and isinstance(v.meta.get("val"), torch.SymInt)]
        for v in user_in:
            val = v.meta.get("val")
            if not isinstance(val, torch.Tensor):
                env[v] = val  # specialised Python value: baked in
                continue
            env[v] = g.placeholder(v.name)
            if s == 0:  # the stage given the data reads it; later stages get it sent by stage 0's rank
                sources.append(StageInput(len(sources), InputKind.MODEL, v.name, model_input=self.input_index[v.name]))
            else:
                spec = spec_of(v, self.rg[v], self.known_symbols, self.rename)
                edge = Edge(MODEL_INPUT, self.input_index[v.name], s, len(sources), spec, v.name, v.name)
                edges.append(edge)
                sources.append(StageInput(len(sources), InputKind.EDGE, v.name, edge=edge))
        for v in received:
            src = cast(int, self.stage_of(v))  # received from the stage that computes it
            spec = spec_of(v, self.rg[v], self.known_symbols, self.rename)
            env[v] = g.placeholder(v.name)
            edge = Edge(src, out_index[src][v], s, len(sources), spec, v.name, self.label(v))
            edges.append(edge)
            sources.append(StageInput(len(sources), InputKind.EDGE, v.name, edge=edge))
        for v in symbolic:
            expr = sympy.sympify(v.meta["val"].node.expr)
            if expr.is_number:
                env[v] = int(expr)
                continue
            if expr.free_symbols - self.known_symbols:
                raise SplitError(f"size {v.name!r} = {expr} crosses into stage {s} but depends on data; move the split")
            env[v] = g.placeholder(f"sym_{v.name}")
            sources.append(StageInput(len(sources), InputKind.SYMBOL, v.name, expr=expr.xreplace(self.rename)))
        return sources, edges

    def _attributes(self, s: int, g: torch.fx.Graph, env: dict, root: torch.nn.Module, attrs: list,
                    stage_set: set, installed: dict) -> tuple[list[str], list[tuple[str, torch.Tensor, bool]]]:
        """Install the parameters, buffers and lifted constants stage ``s`` reads on ``root``
        under every name the stage uses for them; ``(param_fqns, installs)``."""
        param_fqns = []
        installs = []  # (fqn, tensor, is_buffer): every name the stage holds the tensor under
        for v in attrs:
            users = [u for u in v.users if u in stage_set]
            if v.name in self.traced.constants:
                attr = f"_const_{v.name}"
                root.register_buffer(attr, self.traced.ep.constants[self.traced.constants[v.name]], persistent=False)
                env[v] = g.get_attr(attr)
                continue
            canonical = self.traced.params.get(v.name) or self.traced.buffers[v.name]
            names = self._aliases_for(canonical, users)
            tensor = self.model.get_parameter(canonical) if v.name in self.traced.params else self.model.get_buffer(canonical)
            for name in names:
                is_buffer = v.name in self.traced.buffers
                _install(root, name, tensor, buffer=is_buffer, persistent=name not in self.traced.non_persistent)
                installs.append((name, tensor, is_buffer))
                param_fqns.append(name)
            holders = installed.setdefault(self._key(canonical), [])
            if holders and holders[-1][0] == s:  # the same tensor reached through another alias
                holders[-1][1].extend(n for n in names if n not in holders[-1][1])
            else:
                holders.append((s, list(names)))
            env[v] = g.get_attr(names[0])
        return param_fqns, installs

    def _copy_ops(self, g: torch.fx.Graph, env: dict, root: torch.nn.Module, ops: list) -> tuple[list, int]:
        """Copy the stage's ops into ``g``; ``(module call paths in order, forward FLOPs)``."""
        modules: dict[tuple[str, ...], None] = {}
        flops = 0
        for op in ops:
            for a in op.all_input_nodes:
                if a.op == "get_attr" and a not in env:
                    root.add_module(a.target, self.traced.ep.graph_module.get_submodule(a.target))
                    env[a] = g.get_attr(a.target)
            env[op] = g.node_copy(op, lambda a: env[a])
            paths = tuple(module_paths(op))
            if paths:
                modules.setdefault(paths, None)
            if op.target is not operator.getitem:
                flops += node_flops(op)
        return list(modules), flops

    def _module(self, s: int, root: torch.nn.Module, g: torch.fx.Graph,
                installs: list[tuple[str, torch.Tensor, bool]]) -> GraphModule:
        module = GraphModule(root, g, class_name=f"Stage{s}")
        # GraphModule copies only what the graph reads; a tied tensor's other names
        # (head.weight beside tok_emb.weight in one stage) must be there too.
        for name, tensor, is_buffer in installs:
            _install(module, name, tensor, buffer=is_buffer, persistent=name not in self.traced.non_persistent)
        for name, buf in list(root.named_buffers()):
            if name in self.traced.non_persistent or name.startswith("_const_"):
                mod_path, _, leaf = name.rpartition(".")
                module.get_submodule(mod_path).register_buffer(leaf, buf, persistent=False)
        return module

    def _place_unused(self, stages: list[StageInfo], installed: dict) -> None:
        """Parameters no op reads (and tied names never called) still belong somewhere:
        stage 0 (or the first stage holding the tensor), so the stages' state dicts
        together hold every key of the model's."""
        have = {name for st in stages for name in st.param_fqns}
        for ph, canonical in {**self.traced.params, **self.traced.buffers}.items():
            for name in self.traced.aliases.get(canonical, [canonical]):
                if name in have:
                    continue
                holders = [s for s, _ in installed.get(self._key(canonical), [])]
                s = holders[0] if holders else 0
                is_buffer = ph in self.traced.buffers
                tensor = self.model.get_buffer(canonical) if is_buffer else self.model.get_parameter(canonical)
                _install(stages[s].module, name, tensor, buffer=is_buffer, persistent=name not in self.traced.non_persistent)
                stages[s].param_fqns.append(name)
                have.add(name)


def _name_module_ranges(stages: list[StageInfo]) -> None:
    """Describe each stage by modules at the shallowest depth that tells stages apart
    (``blocks.3`` for a GPT, ``model.layers.3`` for an HF model, not just ``model``)."""
    all_paths = [p for st in stages for p in st.modules]
    depth_max = max((len(p) for p in all_paths), default=0)
    chosen = 1
    for depth in range(1, depth_max + 1):
        chosen = depth
        if len({p[min(depth, len(p)) - 1] for p in all_paths}) > len(stages):
            break
    for st in stages:
        names: dict[str, None] = {}
        for p in st.modules:
            names.setdefault(p[min(chosen, len(p)) - 1], None)
        st.modules = list(names)


def build_stages(traced: Traced, plan: Partition, model: torch.nn.Module) -> Built:
    """Stage modules, edges, symbols and output mapping for ``plan``."""
    return _Builder(traced, plan, model).build()
