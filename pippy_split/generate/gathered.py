"""Generation on stages under FSDP2 or tensor parallelism: the shards made whole for one call.

Decoding does not run a stage's training forward. It runs the decode program
(:mod:`.program`), a second trace of the model cut like the training pipe, which calls
some of the user's modules whole (a projection, an MLP) and reads the other parameters in
traced ops bound to the training stage's live tensors (``bind_live`` in
:mod:`.distributed`). Under FSDP2 (``fully_shard``, per block or on the stage) and tensor
parallelism (``parallelize_module``) those tensors are DTensor shards and the modules carry
torch.distributed's forward hooks; the decode program can run with neither. For the
duration of one ``generate()`` call, :func:`unsharded_stages`:

1. traces the decode program, on a Pipe's first call, with a zero-memory stand-in of each
   DTensor's full shape (the trace needs shapes only; it keeps what it traced on);
2. puts each DTensor parameter and buffer of this rank's stages, in place in its module,
   as its full tensor: ``DTensor.full_tensor()``, an all-gather over the DTensor's mesh
   dims, so one path serves FSDP2, TP and FSDP2 x TP. Per stage in the order of
   ``sched.stages``, per parameter in the order of its name: every rank of a DP or TP
   group holds the same stages, so it runs the same collectives in the same order;
3. suspends the forward hooks torch.distributed registered on the stages' modules (TP's
   input/output redistribution, FSDP2's unshard/reshard): the decode runs the model
   unsharded, as the unsplit reference does, token for token;
4. on exit, also when the call failed, puts back every original tensor and hook (the
   optimizer's parameter objects are never replaced, only lent out) and drops the decode
   program's references to the full tensors, which frees them.

Memory: the full parameters and buffers of every stage this rank holds, on top of the
shards, for the duration of the call (one full copy; under per-block FSDP2 every block of
the stage at once, not one block at a time as in training). Nothing stays after the call.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..split.materialize import set_tensor
from ..split.module_calls import parent_of
from ..split.pipe import Pipe
from ..stage.stage import PipelineStage
from .programs import Program, decode_program
from .stand_ins import stand_in

__all__ = ["Gathered", "traced_program", "unsharded_stages"]

# Where the hooks of TP (distribute_module) and FSDP2 (fully_shard) are defined.
_DISTRIBUTED_HOOKS = ("torch.distributed.tensor", "torch.distributed.fsdp")

_Entry = tuple[torch.nn.Module, str, torch.Tensor]  # (stage module, FQN, DTensor)


@dataclass
class Gathered:
    """What one ``generate()`` call made whole on this rank (its extra memory)."""

    tensors: int = 0
    """DTensors gathered (one all-gather each)."""
    numel: int = 0
    """Elements held whole for the call, beyond the shards."""
    nbytes: int = 0
    refs: list[weakref.ref] = field(default_factory=list, repr=False)

    def freed(self) -> bool:
        """Whether every full tensor of the call is gone (true after the call)."""
        return all(r() is None for r in self.refs)


@contextlib.contextmanager
def unsharded_stages(stages: Sequence[PipelineStage], pipe: Pipe, prompt_len: int | None = None
                     ) -> Iterator[Gathered]:
    """For the duration of the ``with``: the DTensor parameters and buffers of ``stages``
    whole, torch.distributed's forward hooks on their modules suspended, and ``pipe``'s
    decode program traced (for prompts of ``prompt_len``: :func:`~.programs.decode_program`).
    Every rank of each DP/TP group calls it with the same stages.

    Stages without DTensors gather nothing; their torch.distributed hooks are suspended all the same.

    Example:
        >>> with unsharded_stages(sched.stages, pipe) as g:  # doctest: +SKIP
        ...     program = decode_program(pipe)   # bind, decode: plain tensors everywhere
        >>> g.freed()  # doctest: +SKIP
        True
    """
    modules = [st.module for st in stages]
    sharded = _sharded(modules)
    gathered = Gathered()
    if not sharded:  # FSDP2 over one rank (torchtitan's DeepSeek-V3 at dp_shard=1) holds no DTensor, still hooks
        plain: list[Callable[[], None]] = []
        _suspend_hooks(modules, plain)
        try:
            yield gathered
        finally:
            _undo(plain)
        return
    undo: list[Callable[[], None]] = []
    whole: dict[int, torch.Tensor] = {}
    program = None
    try:
        program = traced_program(stages, pipe, prompt_len)
        _suspend_hooks(modules, undo)
        _lend(sharded, _full, whole, undo)
        gathered.tensors = len(whole)
        gathered.numel = sum(t.numel() for t in whole.values())
        gathered.nbytes = sum(t.numel() * t.element_size() for t in whole.values())
        gathered.refs = [weakref.ref(t) for t in whole.values()]
        yield gathered
    finally:
        _undo(undo)
        if program is not None:
            _unbind(program, stages, {id(new): old for old, new in _pairs(sharded, whole)})
        whole.clear()


def traced_program(stages: Sequence[PipelineStage], pipe: Pipe, prompt_len: int | None = None) -> Program:
    """``pipe``'s decode program (:func:`~.programs.decode_program`, traced on the Pipe's first
    call), with each DTensor of ``stages`` stood in by a zero-memory tensor of its full shape and
    torch.distributed's hooks suspended while it traces: no collective, so a rank can trace it
    before the ranks agree on the call, and a trace that fails on one rank fails every rank there.

    Example:
        >>> program = traced_program(sched.stages, pipe, prompt_len=8)  # doctest: +SKIP
    """
    cached = pipe.derived.get("decode_program")
    if cached is not None:  # traced by an earlier call: nothing to stand in for
        return cached
    modules = [st.module for st in stages]
    undo: list[Callable[[], None]] = []
    try:
        _suspend_hooks(modules, undo)
        _lend(_sharded(modules), stand_in, {}, undo)
        return decode_program(pipe, prompt_len)
    finally:
        _undo(undo)


def _sharded(modules: Sequence[torch.nn.Module]) -> list[_Entry]:
    from torch.distributed.tensor import DTensor

    out: list[_Entry] = []
    for m in modules:
        named = [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]
        out.extend((m, name, t) for name, t in sorted(named, key=lambda nt: nt[0]) if isinstance(t, DTensor))
    return out


def _pairs(sharded: list[_Entry], whole: dict[int, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t, whole[id(t)]) for _, _, t in sharded if id(t) in whole]


def _like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` as what ``old`` was registered as (a Parameter or a buffer), never requiring grad."""
    return torch.nn.Parameter(new, requires_grad=False) if isinstance(old, torch.nn.Parameter) else new


def _full(t: Any) -> torch.Tensor:
    with torch.no_grad():
        full = t.full_tensor()
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor: the plain tensor once done
    return _like(t, wait() if callable(wait) else full)


def _lend(sharded: list[_Entry], make: Callable[[torch.Tensor], torch.Tensor], made: dict[int, torch.Tensor],
          undo: list[Callable[[], None]]) -> None:
    """Put ``make(t)`` where each DTensor ``t`` is registered (once per tensor: tied names and
    modules two stages share get the same one); ``undo`` puts ``t`` back."""
    for root, name, t in sharded:
        parent, leaf = parent_of(root, name)
        store: dict[str, Any] = parent._parameters if leaf in parent._parameters else parent._buffers
        if store.get(leaf) is not t:
            continue  # already lent through another name of the same module
        new = made.get(id(t))
        if new is None:
            new = made[id(t)] = make(t)
        store[leaf] = new
        undo.append(functools.partial(store.__setitem__, leaf, t))


def _from_torch_distributed(hook: Any) -> bool:
    fn = hook
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return (getattr(fn, "__module__", None) or "").startswith(_DISTRIBUTED_HOOKS)


def _suspend_hooks(modules: Sequence[torch.nn.Module], undo: list[Callable[[], None]]) -> None:
    seen: set[int] = set()
    for root in modules:
        for mod in root.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            for attr in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = mod.__dict__[attr]
                keep = OrderedDict((k, h) for k, h in hooks.items() if not _from_torch_distributed(h))
                if len(keep) < len(hooks):
                    mod.__dict__[attr] = keep
                    undo.append(functools.partial(mod.__dict__.__setitem__, attr, hooks))


def _undo(undo: list[Callable[[], None]]) -> None:
    while undo:
        undo.pop()()


def _unbind(program: Any, stages: Sequence[Any], back: dict[int, torch.Tensor]) -> None:
    """Point the decode program's own parameters and buffers that were bound to a full tensor
    back at the live DTensor (the next call binds them again), so that nothing keeps it."""
    for st in stages:
        module = program.stage_module(st.stage_index)
        for name, t in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            old = back.get(id(t))
            if old is None:
                continue
            set_tensor(module, name, old)
