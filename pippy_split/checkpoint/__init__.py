"""Checkpoints keyed by the original model's FQNs, so that any pipeline layout loads any other.

Where this sits: beside the flow split → Pipe → stage → schedule → runtime. A stage
module's ``state_dict()`` keys are the unsplit model's own names
(``blocks.2.attn.qkv.weight``), so a checkpoint written from the stages of one
layout is just the model's state dict, spread over the ranks that held it. It is
written with ``torch.distributed.checkpoint`` (DCP), which reads back by key: each
rank loads exactly the keys its stages hold, whatever layout wrote them.

    import pippy_split as ps
    from pippy_split import checkpoint

    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 8, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for st in sched.stages for p in st.module.parameters()])
    ...
    checkpoint.save("ckpt/step100", sched, opt, extra={"step": 100})   # on every rank

    # later: another split, another number of ranks, or the plain model in one process
    extra = checkpoint.load("ckpt/step100", model, opt2)                 # -> {"step": 100}

Layout on disk: one DCP directory (``.metadata`` plus one ``__<rank>_0.distcp`` file
per writing rank) holding flat keys

    model.<fqn>                        parameters and persistent buffers
    optim.state.<fqn>.<name>           optimizer state (exp_avg, step, ...)
    optim.param_groups.<fqn>.<name>    the hyperparameters of the parameter's group
    extra                              the picklable ``extra`` of ``save``
    pippy_split                        format version and the writing layout

The ``model.`` and ``optim.`` keys are those of ``torch.distributed.checkpoint``'s
own ``{"model": ..., "optim": ...}`` convention with flattened optimizer state,
so an unsplit model can also read the weights with plain DCP,
``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``, and the optimizer
with ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(...,
options=StateDictOptions(flatten_optimizer_state_dict=True))``.

Safety: a save writes into a fresh sibling ``<path>.tmp-XXXX`` and only when every
rank has finished swaps it with ``<path>`` (an atomic exchange of the two
directories on Linux; elsewhere a rename of the old one to ``<path>.old-XXXX``
first). A save that fails or is killed part-way leaves the previous checkpoint
in place; ``load`` never reads a ``.tmp-`` directory, and finds the ``.old-``
copy if a save died between the two renames of the fallback. Leftovers of
killed saves are removed by the next save to the same path.

No numpy: torch does not depend on it, but its object collectives
(``all_gather_object``, ``broadcast_object_list``, ``gather_object``,
``scatter_object_list``) decode what they receive with ``tensor.numpy()``, and
DCP's multi-rank ``save``/``load`` coordinate through them. So the ranks here
exchange pickles as uint8 tensors themselves (``comm.Comm``), a save runs DCP's
steps (planner, storage writer) over those, and a load reads on each rank alone
(DCP's global load plan is just the ranks' own plans). The files are DCP's.

Inside: ``saving`` (:func:`save`), ``loading`` (:func:`load`, :func:`saved_keys`),
``layout`` (the key layout and :class:`CheckpointError`), ``keys`` (what a rank holds
as keys), ``files`` (safe writing; :func:`files.save_file` for one file) and ``comm``
(DCP's save protocol over numpy-free collectives). Their shared names are the
package's internals; the public ones are those below.

:func:`save`, :func:`load` and :func:`saved_keys` are imported on first use (PEP 562,
as in :mod:`pippy_split`): they need the stage and DCP stack, which the parts that write
files (``files``, ``layout``: the train job's run directory and ``model.pt``) do not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .layout import CheckpointError

# name -> the module (relative to this package) that defines it
_HOMES = {"save": ".saving", "load": ".loading", "saved_keys": ".loading"}

if TYPE_CHECKING:
    from .loading import load, saved_keys
    from .saving import save


def __getattr__(name: str) -> Any:
    """Import a public function's module on first use and keep the name here."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = ["CheckpointError", "save", "load", "saved_keys"]
