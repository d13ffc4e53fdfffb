"""torchtitan's pipelining extension point, answered by pippy_split.

A torchtitan ``ModelSpec`` names the function that turns the model the Trainer built (on
``meta``) into a pipeline schedule and this rank's model parts: ``pipelining_fn``, by default
torchtitan's own ``pipeline_llm`` (hand-listed FQNs per stage, run by
``torch.distributed.pipelining``). :func:`pipeline_llm` here has the same signature and return
value and splits by tracing instead: balanced cuts (no FQN lists), skip edges, every schedule
(V and DualPipeV included), and ``sched.generate`` on the trained stages.

    from pippy_split.integrations.torchtitan import pipeline_llm
    spec = dataclasses.replace(torchtitan.models.llama3.model_registry("8B"), pipelining_fn=pipeline_llm)

Where it sits: above :mod:`pippy_split.split` (``ps.pipeline``), :mod:`pippy_split.stage` and
:mod:`pippy_split.compat` (whose schedule classes take the Trainer's
``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=, return_outputs=False)``). It
imports nothing of torchtitan: its objects are read by the names the Trainer uses (under TP,
:mod:`~pippy_split.integrations.torchtitan_tensor_parallel` reads the model's sharding config with
torchtitan's own resolver).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch

from ..compat.schedules import PipelineScheduleSingle, get_schedule_class
from ..compat.stage import PipelineStage, adopt
from ..schedule.orders import get_order_spec
from ..schedule.pipeline_schedule import PipelineSchedule
from ..split import Pipe, pipeline
from ..split.materialize import init_from_owners
from ..stage.groups import process_group
from .torchtitan_tensor_parallel import TensorParallelCut, parallelize_children

__all__ = ["pipeline_llm", "init_part_weights"]


def pipeline_llm(model: torch.nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any,
                 compile_config: Any, ac_config: Any, dump_folder: str, device: torch.device, model_config: Any,
                 parallelize_fn: Callable[..., torch.nn.Module], loss_fn: Callable[..., Any]
                 ) -> tuple[Any, list[torch.nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn``: split ``model`` by tracing, build this rank's stages and schedule.

    The signature and return value of ``torchtitan.distributed.pipeline_parallel.pipeline_llm``
    (torchtitan 0.3.0); the Trainer calls it with keywords after building ``model`` on ``meta``.

    Args:
        model: the whole model (on ``meta`` as the Trainer builds it, or real).
        parallel_dims: torchtitan's ``ParallelDims``; its ``"pp"`` mesh is the pipeline's group.
        training: ``TrainingConfig``: ``local_batch_size`` and ``seq_len`` size the traced microbatch.
        parallelism: ``ParallelismConfig``: ``pipeline_parallel_schedule`` (any of pippy_split's
            names), ``pipeline_parallel_microbatch_size``, ``pipeline_parallel_layers_per_stage``
            (sets the stage count as in torchtitan) and ``module_fqns_per_model_part`` (if given,
            each part's first module starts a stage; otherwise the cuts are balanced by FLOPs).
        compile_config / ac_config / dump_folder: handed to ``parallelize_fn``.
        device: where this rank's stages run.
        model_config: the model's config (unused: the trace knows the layers).
        parallelize_fn: torchtitan's per-part ``parallelize_fn`` (TP, AC, compile, FSDP2), applied to
            each stage module, which answers ``tok_embeddings`` / ``layers`` / ``norm`` /
            ``lm_head`` as a torchtitan model part does (``None`` where another stage holds it) and
            ``parallelize(parallel_dims)`` (TP: each of its torchtitan modules' own).
        loss_fn: torchtitan's loss, ``(pred, labels, global_valid_tokens) -> (loss, metrics)``.

    Returns:
        ``(schedule, model_parts, has_first_stage, has_last_stage)``: a
        :mod:`pippy_split.compat` schedule (``scale_grads=False``, as torchtitan builds it), this
        rank's stage modules (their state-dict keys are the model's FQNs; ``to_empty`` and
        ``init_weights(buffer_device=)`` work as the Trainer calls them), and whether this rank
        holds the first / last stage.

    Raises:
        ValueError: a schedule name pippy_split does not know, batch sizes that do not divide,
            a stage count the schedule cannot run on the ``pp`` ranks.
        NotImplementedError: context parallelism, TP outside torchtitan's ``partial_dtensor``
            backend, a CSV schedule, tied embeddings (``enable_weight_tying``): each named, with
            what works instead.

    Example (a torchtitan model spec using it; the Trainer does the rest):
        >>> import dataclasses
        >>> from pippy_split.integrations.torchtitan import pipeline_llm
        >>> # spec = dataclasses.replace(llama3.model_registry("8B"), pipelining_fn=pipeline_llm)
        >>> callable(pipeline_llm)
        True
    """
    _refuse_unsupported(parallel_dims, parallelism, model)
    cls = cast(type[PipelineSchedule], get_schedule_class(parallelism.pipeline_parallel_schedule))
    pipe = _split(model, training, parallelism, cls, torch.device(device))
    setup = _PartSetup(parallelize_fn, dict(parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                            compile_config=compile_config, ac_config=ac_config,
                                            dump_folder=dump_folder))
    stages = _build_stages(pipe, model, cls, device, setup)
    schedule = _schedule(cls, stages, training.local_batch_size // parallelism.pipeline_parallel_microbatch_size,
                         loss_fn)
    parts = [st.submod for st in stages]
    return schedule, parts, any(st.is_first for st in stages), any(st.is_last for st in stages)


@dataclass(frozen=True)
class _PartSetup:
    """What turns a stage module into a torchtitan model part: torchtitan's ``parallelize_fn`` and
    the keywords the Trainer gave ``pipeline_llm`` for it."""

    parallelize_fn: Callable[..., torch.nn.Module]
    kwargs: dict[str, Any]
    """``parallel_dims``, ``training``, ``parallelism``, ``compile_config``, ``ac_config``, ``dump_folder``."""

    @property
    def parallel_dims(self) -> Any:
        return self.kwargs["parallel_dims"]


def _split(model: torch.nn.Module, training: Any, parallelism: Any, cls: type[PipelineSchedule],
           device: torch.device) -> Pipe:
    """``ps.pipeline`` on one microbatch of tokens: balanced cuts moved to block starts (torchtitan's
    ``parallelize_fn`` works per block), or the first module of each of ``module_fqns_per_model_part``."""
    mb_size = parallelism.pipeline_parallel_microbatch_size
    if training.local_batch_size % mb_size != 0:
        raise ValueError(f"Batch size {training.local_batch_size} must be divisible by microbatch_size {mb_size}. "
                         "Update the config arguments for either batch_size or pipeline_parallel_microbatch_size.")
    num_stages = _stage_count(parallelism, get_order_spec(cls.order_name).default_stages_per_rank(), model)
    example = torch.zeros(mb_size, training.seq_len, dtype=torch.long)
    split_spec: Any = num_stages
    if parallelism.module_fqns_per_model_part is not None:
        split_spec = [part[0] for part in parallelism.module_fqns_per_model_part[1:]]
    with _autocast_as_on(device):
        pipe = pipeline(model, split_spec, (example,))
        cuts = _block_starts(pipe, model) if isinstance(split_spec, int) else None
        if cuts is not None:  # a balanced cut entered a block
            pipe = pipeline(model, cuts, (example,))
    return pipe


def _build_stages(pipe: Pipe, model: torch.nn.Module, cls: type[PipelineSchedule], device: torch.device,
                  setup: _PartSetup) -> list[PipelineStage]:
    """This ``pp`` rank's stages (the schedule's placement), each module made a torchtitan model
    part and handed to ``parallelize_fn``."""
    pp_mesh = setup.parallel_dims.get_mesh("pp")
    group = process_group(pp_mesh, "pipeline_llm")
    placement = cls.stage_placement(pipe.num_stages, pp_mesh.size())
    cut = TensorParallelCut.of(model, setup.parallel_dims)
    if cut is not None:
        cut.check([pipe.get_stage_module(s) for s in range(pipe.num_stages)])
    stages = []
    for s in sorted(s for s, r in placement.items() if r == pp_mesh.get_local_rank()):
        stage = adopt(pipe.build_stage(s, device, group))
        _torchtitan_face(stage.submod, model)
        if cut is not None:
            cut.prepare(stage)
        stage.submod = setup.parallelize_fn(stage.submod, **setup.kwargs)
        stages.append(stage)
    return stages


def _schedule(cls: type[PipelineSchedule], stages: list[PipelineStage], n_microbatches: int,
              loss_fn: Callable[..., Any]) -> PipelineSchedule:
    """The compat schedule over this rank's stages, as torchtitan builds it (``scale_grads=False``:
    torchtitan's loss already divides by the step's valid tokens)."""

    def scalar_loss(*args: Any, **kwargs: Any) -> torch.Tensor:  # the schedule wants a bare scalar
        loss, _ = loss_fn(*args, **kwargs)
        return loss

    one = issubclass(cls, PipelineScheduleSingle)
    return cls(stages[0] if one else stages, n_microbatches, loss_fn=scalar_loss,  # type: ignore[call-arg]
               scale_grads=False)


def init_part_weights(part: torch.nn.Module, model: torch.nn.Module, buffer_device: torch.device | None = None) -> None:
    """A model part's ``init_weights(buffer_device=)``, as torchtitan's ``init_states`` does for a whole model.

    Every module of ``part`` that is the user's own object and speaks torchtitan's module
    protocol (``init_states``) initialises itself in place (its DTensor shards included, after
    ``fully_shard``); a tensor the stage holds outside such a module (traced ops of a module the
    cut entered) is initialised from its owner in ``model`` (:func:`~pippy_split.split.materialize.init_from_owners`).

    Example:
        >>> part = torch.nn.Linear(2, 2)
        >>> init_part_weights(part, part)   # no init_states: its reset_parameters()
    """
    done: list[str] = []
    for name, module in part.named_modules():
        if module is part or any(name.startswith(d + ".") for d in done):
            continue
        init_states = getattr(module, "init_states", None)
        if callable(init_states):
            init_states(buffer_device=buffer_device)
            done.append(name)
    rest = {n: t for n, t in [*part.named_parameters(remove_duplicate=False), *part.named_buffers(remove_duplicate=False)]
            if not any(n.startswith(d + ".") for d in done)}
    if rest:
        device = buffer_device or next(iter(rest.values())).device
        init_from_owners(rest, model, device)


class _InitWeights:
    """``part.init_weights(buffer_device=None)``: :func:`init_part_weights` over the model the part came from."""

    def __init__(self, part: torch.nn.Module, model: torch.nn.Module) -> None:
        self.part, self.model = part, model

    def __call__(self, buffer_device: torch.device | None = None, **_: Any) -> None:
        init_part_weights(self.part, self.model, buffer_device)


def _torchtitan_face(part: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make a stage module answer what torchtitan reads of a model part: each top-level child of
    the model (``None`` where another stage holds it), a ``layers`` container of the model's own
    class (a ``ModuleDict`` keeps ``.items()``) holding the stage's blocks, the model's public plain
    attributes the stage module lacks (``enable_weight_tying``, ``config``, DeepSeek-V3's
    ``mtp_layers = None``), and ``init_weights``."""
    for name, child in model.named_children():
        held = part._modules.get(name)
        if held is None and isinstance(child, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            part._modules[name] = type(child)()  # as torchtitan's own split leaves it: empty, still iterable
        elif held is None:
            object.__setattr__(part, name, None)
        elif isinstance(child, torch.nn.ModuleDict) and not isinstance(held, torch.nn.ModuleDict):
            container = type(child)()
            for key, block in held.named_children():
                container[key] = block
            for key, p in held.named_parameters(recurse=False):
                container.register_parameter(key, p)
            for key, b in held.named_buffers(recurse=False):
                container.register_buffer(key, b, persistent=key not in held._non_persistent_buffers_set)
            part._modules[name] = container
    for name, value in vars(model).items():  # plain attributes torchtitan reads (enable_weight_tying, mtp_layers=None)
        if not name.startswith("_") and name != "training" and not hasattr(part, name):
            object.__setattr__(part, name, value)
    object.__setattr__(part, "init_weights", _InitWeights(part, model))
    object.__setattr__(part, "parallelize", functools.partial(parallelize_children, part))


class _AutocastOn(torch.autocast):
    """``torch.autocast`` for a trace of a model on ``meta`` that will run on ``device``:
    ``device_type="meta"`` (what ``x.device.type`` reads there) becomes ``device``'s type."""

    target = "cpu"

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.target if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def _autocast_as_on(device: torch.device) -> Iterator[None]:
    """For the trace: a forward that enters ``torch.autocast(device_type=x.device.type)`` (DeepSeek-V3's
    and Qwen3's MoE routers) asks for ``"meta"`` on the Trainer's meta model, which torch refuses;
    it enters the autocast it will enter on ``device``, where the stages run."""
    saved = torch.autocast, torch.amp.autocast, _AutocastOn.target
    _AutocastOn.target = device.type
    torch.autocast = torch.amp.autocast = _AutocastOn  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast, _AutocastOn.target = saved  # type: ignore[misc]


def _block_starts(pipe: Pipe, model: torch.nn.Module) -> list[str] | None:
    """Where each stage after the first begins, moved to the start of the block of ``model.layers`` a
    balanced cut entered; None when every cut lies between blocks (or the model has no ``layers``)."""
    try:
        layers = model.get_submodule("layers")
    except AttributeError:
        return None
    blocks = [f"layers.{key}" for key, _ in layers.named_children()]
    starts, entered = [], False
    for i in range(1, pipe.num_stages):
        module = pipe.get_stage_module(i)
        held = [b for b in blocks if _holds(module, b)]
        if not held:
            return None
        starts.append(held[0])
        entered |= module.get_submodule(held[0]) is not model.get_submodule(held[0])
    ordered = all(blocks.index(a) < blocks.index(b) for a, b in zip(starts, starts[1:]))
    return starts if entered and ordered else None


def _holds(module: torch.nn.Module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def _stage_count(parallelism: Any, per_rank: int, model: torch.nn.Module) -> int:
    """Stages over all ``pp`` ranks: ``pipeline_parallel_layers_per_stage`` as torchtitan counts it, else the
    schedule's default per rank (1 for single-stage schedules, 2 for the others) times the ranks."""
    pp = parallelism.pipeline_parallel_degree
    if parallelism.module_fqns_per_model_part is not None:
        return len(parallelism.module_fqns_per_model_part)
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    if layers_per_stage is None:
        return pp * per_rank
    layers = sum(1 for _ in model.get_submodule("layers").children())
    effective = (layers + parallelism.pipeline_parallel_first_stage_less_layers
                 + parallelism.pipeline_parallel_last_stage_less_layers)
    return math.ceil(effective / layers_per_stage)


def _refuse_unsupported(parallel_dims: Any, parallelism: Any, model: torch.nn.Module) -> None:
    """What ``pipeline_llm`` cannot run exactly, refused by name before anything is traced (the same
    on every rank: it reads only the configs)."""
    if getattr(parallel_dims, "cp_enabled", False):
        raise NotImplementedError(
            "pippy_split's pipeline_llm: context parallelism (cp > 1) is not supported (each cp rank would run "
            "its stages on a slice of the sequence, while the traced stages and their messages are sized for "
            "the whole of it). What works: pp x tp x FSDP2 (data_parallel_shard_degree), AC and compile with "
            "this pipelining_fn")
    backend = getattr(parallelism, "spmd_backend", "partial_dtensor")
    if getattr(parallel_dims, "tp_enabled", False) and backend != "partial_dtensor":
        raise NotImplementedError(
            f"pippy_split's pipeline_llm: tensor parallelism with spmd_backend={backend!r} is not supported (its "
            "stages take and return DTensors or typed SPMD values, which cross stages here as plain tensors). "
            "What works: tp with spmd_backend='partial_dtensor' (torchtitan's default)")
    if getattr(parallelism, "pipeline_parallel_schedule_csv", None):
        raise NotImplementedError(
            "pippy_split's pipeline_llm: pipeline_parallel_schedule_csv is not supported; name a schedule in "
            "pipeline_parallel_schedule, or run your own order with pippy_split.schedule.ScheduleFromOrder")
    if getattr(model, "enable_weight_tying", False):
        raise NotImplementedError(
            "pippy_split's pipeline_llm: enable_weight_tying=True is not supported. torchtitan 0.3.0 refuses it "
            "with pipeline parallelism itself (Decoder.Config.update_from_config), and its Trainer could not run it "
            "exactly: to_empty() unties the embedding (first stage) and lm_head (last stage), which only the whole "
            "model's init_states ties again, and its clip_grad_norm_ sums every part's gradients over the pp ranks, "
            "counting a weight two parts hold twice. What works: a config with enable_weight_tying=False, or tied "
            "weights through ps.pipeline and ps.build_schedule (gradients summed, ps.clip_grad_norm_ counts them once)")
