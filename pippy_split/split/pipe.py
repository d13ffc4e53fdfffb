"""``Pipe``: the split model — stage modules, edges, summary — and ``pipeline()``.

End of the split half of the flow (split → **Pipe** → stage → schedule → runtime).
A Pipe runs all its stages in one process (``pipe(x) == model(x)``); it knows
stages, never ranks. ``pipe.build_stage(i)`` is the one-line entry to the stage
layer (``PipelineStage.from_pipe``), which asks the Pipe for the stage's filled
module (:meth:`Pipe.fill_stage_module`) and its inputs and edges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import sympy
import torch

from .autocast_trace import TraceRecipe
from .calls import call_tree
from .errors import SplitError
from .functions import check_functions_called
from .hand_over import Generation, StageOptionsView, driver
from .module_calls import called_module_names
from .partition import Partition, check_balance, check_split_spec, plan_from_cuts, plan_stages, split_fqns
from .spec import MODEL_INPUT, Edge, SymbolSource, gather_inputs
from .stage_graph import StageInfo, build_stages
from .trace import Traced, trace_model

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from ..stage.model_io import ModelInputs, ModelOutputs

__all__ = ["Pipe", "pipeline"]


class Pipe:
    """A model cut into stages. Build it with :func:`pipeline`.

    Attributes:
        num_stages: number of stages.
        edges: every value crossing a cut, from its true producer to each reader.
        shared_parameters: ``{fqn: [(stage, [names in that stage]), ...]}`` for tensors
            held by several stages (tied weights); their gradients must be summed.
        symbols: dynamic-shape symbols and the input dims they are read from.
        balance: each stage's cost under ``pipeline(balance=...)`` (a ``BalanceReport``:
            ``.shares``, ``.ratio``), or None.
    """

    def __init__(self, traced: Traced, stages: list[StageInfo], edges: list[Edge], symbols: list[SymbolSource],
                 output_leaves: list[tuple[str, Any]], shared_parameters: dict, model_name: str,
                 model: torch.nn.Module | None = None, balance: Any = None, *,
                 recipe: TraceRecipe | None = None, plan: Partition | None = None,
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        """Stages cut from ``traced`` (built by :func:`pipeline`, and by the planner per split it prices). ``model``:
        the traced model, not modified, that fills a meta stage's tensors (:meth:`fill_stage_module`); ``balance``:
        the split's ``BalanceReport``; ``recipe``, ``plan``: how it was traced and cut (:meth:`under_autocast`)."""
        from ..stage.model_io import ModelOutputs  # the one home of the output structure, which steps keep

        self._traced = traced
        self.stages = stages
        self.edges = edges
        self.symbols = symbols
        self._outputs = ModelOutputs(output_leaves, traced.out_spec)
        self.shared_parameters = shared_parameters
        self.model_name = model_name
        self._model = model  # the traced model (not modified): owners initialise a meta stage's tensors
        self.balance = balance  # BalanceReport of pipeline(balance=...), or None
        self.derived: dict[str, Any] = {}
        """Facts other layers work out from the pipe once and keep here (e.g. autocast edge specs)."""
        self._recipe = recipe  # how pipeline() traced: the same split can be traced again under autocast
        self._plan = plan
        self.autocast = autocast
        """``(device_type, dtype)`` this pipe was traced under (:meth:`under_autocast`), or None."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model ``pipeline()`` traced (its own object; None for a Pipe built otherwise)."""
        return self._model

    @property
    def input_names(self) -> list[str]:
        """The model's flattened input names, in the order stages refer to them."""
        return list(self._traced.user_inputs)

    @property
    def arg_names(self) -> list[str]:
        """Names of the arguments the traced example passed positionally (for splitting
        ``step()``'s inputs by name)."""
        return list(self._traced.example_arg_names)

    @property
    def model_inputs(self) -> ModelInputs:
        """How a call of the model becomes the flat inputs stages index into, each checked
        against the trace (:meth:`flatten_inputs`); made when tracing, kept by schedules so a
        step runs it without the Pipe."""
        return self._traced.model_inputs

    @property
    def model_outputs(self) -> ModelOutputs:
        """How the last stage's outputs become what the model returns (:meth:`unflatten_outputs`);
        kept by the last stage."""
        return self._outputs

    @property
    def graph(self) -> torch.fx.Graph:
        """The whole model's exported graph (before the cut)."""
        return self._traced.graph

    def example_inputs(self) -> tuple[list[Any], dict[sympy.Symbol, int]]:
        """The traced example, without its data: per flat input a tensor's ``(shape, dtype)``
        (sizes as traced) or a non-tensor's value; and each dynamic symbol's example value.

        Example:
            >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]); x = torch.randn(2, 8)
            >>> pipe = pipeline(model, ["2"], (x,))
            >>> pipe.example_inputs()
            ([((2, 8), torch.float32)], {})
        """
        inputs = self._traced.example_inputs()
        return inputs, {s.symbol: inputs[s.input_index][0][s.dim] for s in self.symbols}

    def get_stage_module(self, stage_index: int) -> torch.fx.GraphModule:
        """The ``nn.Module`` of one stage; its ``state_dict()`` keys are the model's own FQNs."""
        self._check_index(stage_index)
        return self.stages[stage_index].module

    def _check_index(self, stage_index: int) -> None:
        if not 0 <= stage_index < self.num_stages:
            raise IndexError(f"stage index {stage_index} out of range: this pipe has {self.num_stages} stages")

    # ---- running in one process -------------------------------------------------
    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The model's inputs as the flat list stages index into."""
        return self._traced.model_inputs.flatten(tuple(args), dict(kwargs))

    def bind_symbols(self, flat_inputs: Sequence[Any]) -> dict[sympy.Symbol, int]:
        """Values of the dynamic-shape symbols for these inputs."""
        return {s.symbol: int(flat_inputs[s.input_index].shape[s.dim]) for s in self.symbols}

    def stage_inputs(self, stage_index: int, flat_inputs: Sequence[Any], values: dict[tuple[int, int], Any],
                     bindings: dict) -> list[Any]:
        """Gather one stage's positional inputs from model inputs and produced values
        (``values[(stage, output)]``); see :func:`~pippy_split.split.spec.gather_inputs`."""
        produced = {**{(MODEL_INPUT, i): x for i, x in enumerate(flat_inputs)}, **values}
        return gather_inputs(self.stages[stage_index].inputs, flat_inputs, produced, bindings)

    def unflatten_outputs(self, last_stage_outputs: Sequence[Any]) -> Any:
        """Rebuild the model's output structure (tuples, dicts, ModelOutput) from the last stage's outputs."""
        return self._outputs(last_stage_outputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run every stage in order in this process; returns what the model returns. Inside a
        ``torch.autocast`` block the stages traced under that autocast run (:meth:`under_autocast`),
        so the result is the model's under the same autocast."""
        flat = self.flatten_inputs(args, kwargs)
        active = _active_autocast(flat)
        if active is not None and (self.autocast is None or self.autocast[1] != active[1]):
            return self.under_autocast(active[1], active[0])(*args, **kwargs)
        bindings = self.bind_symbols(flat)
        values: dict[tuple[int, int], Any] = {}
        outs: Sequence[Any] = ()
        for stage in self.stages:
            outs = stage.module(*self.stage_inputs(stage.index, flat, values, bindings))
            for i, v in enumerate(outs):
                values[(stage.index, i)] = v
        return self.unflatten_outputs(outs)

    def under_autocast(self, dtype: torch.dtype, device_type: str = "cpu") -> Pipe:
        """This split traced again inside ``torch.autocast(device_type, dtype)``: the stages
        see the dtypes autocast gives (``torch.finfo(x.dtype)`` constants, the model's own
        ``.to(torch.float32)`` upcasts), so run under that autocast they compute what the
        model computes under it. Same cuts, same parameter objects, same FQNs; built once
        and kept. Stages built with ``mixed_precision=`` use it.

        Example:
            >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]); x = torch.randn(2, 8)
            >>> pipe = pipeline(model, ["2"], (x,))
            >>> bf16 = pipe.under_autocast(torch.bfloat16)
            >>> with torch.autocast("cpu", dtype=torch.bfloat16):
            ...     torch.testing.assert_close(bf16(x), model(x))
        """
        from .autocast_trace import trace_device_type, translate_cuts

        if self.autocast is not None and self.autocast[1] == dtype:
            return self
        if self._recipe is None or self._plan is None or self._model is None:
            raise SplitError("this Pipe does not know how it was traced (it was not built by pipeline()), so it "
                             "cannot be traced again under torch.autocast; build it with pippy_split.pipeline()")
        trace_type = trace_device_type(self._model, device_type)
        cache = self.derived.setdefault("under_autocast", {})
        key = (trace_type, dtype)
        if key not in cache:
            r = self._recipe
            with torch.autocast(trace_type, dtype=dtype):
                traced = trace_model(self._model, r.example_args, r.example_kwargs, dynamic_shapes=r.dynamic_shapes,
                                     strict=r.strict, cuts=r.cuts)
            ops = [n for n in traced.graph.nodes if n.op == "call_function"]
            plan = plan_from_cuts(ops, translate_cuts(self._plan.ops, self._plan.cuts, ops))
            plan.balance = self.balance
            pipe = _build_pipe(self._model, traced, plan, r)
            pipe.autocast = (trace_type, dtype)
            cache[key] = pipe
        return cache[key]

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> Generation:
        """Generate from the split model in this process, with a KV cache per stage: the same
        result as ``sched.generate`` (see :meth:`pippy_split.schedule.PipelineSchedule.generate`
        for the arguments), equal to the unsplit model's Hugging Face ``generate``.

        Example:
            >>> from pippy_split import zoo
            >>> e = zoo.get("tiny_gpt")
            >>> pipe = pipeline(e.model, e.split_spec, e.args)
            >>> pipe.generate(e.args[0][:2, :4], max_new_tokens=3).sequences.shape
            torch.Size([2, 7])
        """
        return driver("pipe")(self, input_ids, **kwargs)  # generate/ builds on the Pipe: it provides this

    # ---- building stages for ranks -------------------------------------------------
    def build_stage(self, stage_index: int, device: torch.device | str | None = None,
                    group: ProcessGroup | DeviceMesh | None = None, *, state_dict: Any = None, seed: int = 0,
                    activation_checkpoint: str | Sequence[str] | None = None,
                    mixed_precision: torch.dtype | None = None, compile: bool | Mapping[str, Any] = False,
                    strict: bool = True, options: StageOptionsView | None = None) -> Any:
        """The :class:`pippy_split.PipelineStage` for one stage, its module moved to ``device``
        (built by ``PipelineStage.from_pipe``, which the stage layer hands this layer: see
        :mod:`.hand_over`). ``group``: the stage's process group, ``None`` or a DeviceMesh
        dimension (:data:`pippy_split.stage.groups.GroupArg`).

        ``activation_checkpoint="full"`` recomputes the stage before its backward
        instead of keeping its activations, a list of module FQN patterns
        (``["blocks.*"]``) only the calls of the matching modules; ``mixed_precision=torch.bfloat16`` runs it
        under autocast; ``compile=True`` through ``torch.compile`` (see
        :class:`pippy_split.PipelineStage`); ``options=`` gives the three as one
        :class:`~pippy_split.stage.options.StageOptions` instead.

        For a model built on the ``meta`` device, only this stage's tensors are
        allocated, filled from ``state_dict`` (original FQNs) or by the owning
        modules' ``reset_parameters()`` (seeded per module, identical on every rank;
        a Hugging Face model's ``_init_weights`` where a module has none, which also
        rebuilds non-persistent buffers such as rotary ``inv_freq``, even beside a
        ``state_dict``). Empty constants export lifted out of forward are rebuilt, and
        the graph's ``device=meta`` arguments point at ``device``.

        ``state_dict`` must hold every key this stage needs and no key the model
        lacks (a typo, a ``module.`` prefix): either is a ``SplitError`` naming the
        keys and their closest matches. ``strict=False`` loads the keys that match
        and keeps (or, on meta, initialises) the rest.
        """
        return driver("stage")(self, stage_index, device=device, group=group, state_dict=state_dict,
                                       seed=seed, strict=strict, activation_checkpoint=activation_checkpoint,
                                       mixed_precision=mixed_precision, compile=compile, options=options)

    def fill_stage_module(self, stage_index: int, device: torch.device | str | None = None, *,
                          state_dict: Any = None, seed: int = 0, strict: bool = True) -> torch.fx.GraphModule:
        """One stage's module with real tensors: a meta stage allocated on ``device`` and
        initialised (see :meth:`build_stage`), ``state_dict``'s values loaded. Used by
        ``PipelineStage.from_pipe``; the module is not moved otherwise.

        Example:
            >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]); x = torch.randn(2, 8)
            >>> pipe = pipeline(model, ["2"], (x,))
            >>> module = pipe.fill_stage_module(1, "cpu", state_dict=model.state_dict())
            >>> sorted(module.state_dict())  # the model's own names
            ['2.bias', '2.weight', '3.bias', '3.weight']
        """
        from .materialize import fill_stage

        self._check_index(stage_index)
        known: set[str] = set()  # every key of the model: one outside it in state_dict is a mistake
        if state_dict is not None:
            known = {k for st in self.stages for k in st.module.state_dict()}
            known.update(self._model.state_dict() if self._model is not None else ())
            # non-persistent buffers (a rope cache) are in no state_dict() but may be passed
            known.update(n for st in self.stages for n, _ in st.module.named_buffers(remove_duplicate=False))
            if self._model is not None:
                known.update(n for n, _ in self._model.named_buffers(remove_duplicate=False))
        canonical = {name: names[0] for name, names in self._traced.aliases.items()}
        module = self.stages[stage_index].module
        fill_stage(module, stage_index, self._model, known, device, state_dict=state_dict, seed=seed,
                   canonical=canonical, strict=strict)
        return module

    # ---- summaries ---------------------------------------------------------------
    def __repr__(self) -> str:
        from .summary import pipe_text

        return pipe_text(self)

    def __rich__(self) -> Any:
        from .summary import pipe_rich

        return pipe_rich(self)

    def _repr_html_(self) -> str:
        from .summary import pipe_html

        return pipe_html(self)


def pipeline(
    model: torch.nn.Module,
    split_spec: Any = None,
    example_args: tuple | Any = None,
    example_kwargs: dict | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
    mb_args: tuple | None = None,
    mb_kwargs: dict | None = None,
    balance: str = "flops",
) -> Pipe:
    """Trace ``model`` with ``torch.export`` and cut it into a :class:`Pipe`.

    Args:
        model: any ``nn.Module``; it is not modified.
        split_spec: ``{fqn: SplitPoint.BEGINNING | END}``, a list of FQNs (split at the
            beginning of each), an int N (N stages balanced by ``balance``, cut between any
            two module calls at any depth, preferring repeated-block boundaries), or None
            (cut at ``pipe_split()`` calls in forward).
        example_args / example_kwargs: one microbatch of inputs (``mb_args``/``mb_kwargs``
            are accepted as aliases, as in torch.distributed.pipelining).
        dynamic_shapes: passed to ``torch.export``; declared dynamic dims become sympy
            symbols in edge shapes and may change from batch to batch.
        strict: use export's strict (TorchDynamo) mode.
        balance: the cost an int ``split_spec`` evens out, and the one ``print(pipe)`` shows
            each stage's share of (``pipe.balance``): "flops" (forward FLOPs), "params"
            (parameter bytes), "time" (each op's forward + backward time, measured once
            on the model's device) or "memory" (activation + parameter + gradient + Adam
            state bytes). A warning names the best reachable ratio when the costliest
            stage exceeds 1.15x an even one.

    Returns:
        The Pipe.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]); x = torch.randn(2, 8)
        >>> pipe = pipeline(model, ["2"], (x,))  # a transformer: ["blocks.2"]
        >>> pipe.num_stages, [str(e) for e in pipe.edges]
        (2, ['0.out[0] -> 1.in[0] 1 (linear_1) (2, 8) float32'])
        >>> torch.testing.assert_close(pipe(x), model(x))
        >>> pipe = pipeline(model, 4, (x,), balance="params")  # or "flops", "time", "memory"
        >>> pipe.balance.shares, pipe.balance.ratio
        ((0.25, 0.25, 0.25, 0.25), 1.0)
    """
    example_args, example_kwargs = _example(example_args, example_kwargs, mb_args, mb_kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"pipeline() needs an nn.Module, got {type(model).__name__}")
    check_split_spec(split_spec)  # before tracing: a bad spec costs no export
    check_balance(balance)
    cuts = split_fqns(split_spec)
    traced = trace_model(model, example_args, example_kwargs, dynamic_shapes=dynamic_shapes, strict=strict,
                         cuts=cuts)
    flat = traced.flatten_inputs(example_args, example_kwargs or {}) if balance == "time" else None
    plan = plan_stages(traced.graph, split_spec, model, balance=balance, traced=traced, flat_inputs=flat)
    if split_spec is None and plan.num_stages == 1:
        pass  # a single stage is a valid (if pointless) pipe
    recipe = TraceRecipe(tuple(example_args), dict(example_kwargs or {}), dynamic_shapes, strict,
                         None if cuts is None else tuple(cuts))
    return _build_pipe(model, traced, plan, recipe)


def _build_pipe(model: torch.nn.Module, traced: Traced, plan: Partition, recipe: TraceRecipe) -> Pipe:
    built = build_stages(traced, plan, model)
    if traced.functions:
        called = {fqn for st in built.stages for fqn in called_module_names(st.module)}
        trainable = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        check_functions_called(plan.ops, call_tree(plan.ops), traced.functions, called, traced.kept_traced,
                               traced.module_signatures, traced.params, trainable)
    return Pipe(traced, built.stages, built.edges, built.symbols, built.output_leaves, built.shared_parameters,
                type(model).__name__, model=model, balance=plan.balance, recipe=recipe, plan=plan)


def _active_autocast(flat_inputs: Sequence[Any]) -> tuple[str, torch.dtype] | None:
    """``(device_type, dtype)`` of the autocast active for the inputs' device, or None."""
    device_type = next((x.device.type for x in flat_inputs if isinstance(x, torch.Tensor)), "cpu")
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type)


def _example(args: tuple | object, kwargs: dict | None, mb_args: tuple | None, mb_kwargs: dict | None) -> tuple[tuple, dict | None]:
    """The example microbatch as ``(args tuple, kwargs)``, from either spelling (``mb_*`` as
    in torch.distributed.pipelining)."""
    if mb_args is not None:
        if args is not None:
            raise TypeError("pass example_args or mb_args, not both")
        args = mb_args
    if mb_kwargs is not None:
        if kwargs is not None:
            raise TypeError("pass example_kwargs or mb_kwargs, not both")
        kwargs = mb_kwargs
    if args is None:
        args = ()
    return (args if isinstance(args, tuple) else (args,)), kwargs
