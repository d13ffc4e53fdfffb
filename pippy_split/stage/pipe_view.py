"""What the stage and schedule layers read of a Pipe, as a type: :class:`PipeView`.

A :class:`~pippy_split.split.pipe.Pipe` builds stages (``pipe.build_stage`` calls up into
:class:`~pippy_split.stage.PipelineStage`), so the stage layer cannot name ``Pipe`` without
an import cycle, even a type-only one. It names this protocol instead: the members a stage
built ``from_pipe`` keeps using (its edges, the model's input and output structure, tied
parameters, dynamic symbols), which ``Pipe`` has and mypy checks it against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import sympy
    import torch
    from torch.fx import GraphModule

    from ..split.spec import Edge, SymbolSource
    from ..split.stage_graph import StageInfo
    from .model_io import ModelInputs, ModelOutputs

__all__ = ["PipeView"]


class PipeView(Protocol):
    """The part of a :class:`~pippy_split.split.pipe.Pipe` its stages and schedules read.

    Example:
        >>> import torch, pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> view: PipeView = ps.pipeline(model, ["2"], (torch.randn(2, 4),))
        >>> view.num_stages, [(e.src_stage, e.dst_stage) for e in view.edges]
        (2, [(0, 1)])
    """

    @property
    def num_stages(self) -> int: ...

    @property
    def stages(self) -> Sequence[StageInfo]:
        """Each stage's traced module and how its inputs connect."""
        ...

    @property
    def edges(self) -> Sequence[Edge]:
        """Every value crossing a cut, from its true sender stage to each receiver."""
        ...

    @property
    def symbols(self) -> Sequence[SymbolSource]:
        """The dynamic-shape symbols and the input dims they are read from."""
        ...

    @property
    def shared_parameters(self) -> dict:
        """``{fqn: [(stage, [names in that stage]), ...]}`` for tensors several stages hold."""
        ...

    @property
    def derived(self) -> dict[str, Any]:
        """Facts other layers work out once and keep on the pipe."""
        ...

    @property
    def autocast(self) -> tuple[str, torch.dtype] | None:
        """``(device_type, dtype)`` of the ``torch.autocast`` the pipe was traced under, or None."""
        ...

    @property
    def input_names(self) -> list[str]: ...

    @property
    def arg_names(self) -> list[str]: ...

    @property
    def model_inputs(self) -> ModelInputs:
        """How a call becomes the flat inputs, checked against the trace (kept by schedules)."""
        ...

    @property
    def model_outputs(self) -> ModelOutputs:
        """How the last stage's outputs become what the model returns (kept by the last stage)."""
        ...

    def example_inputs(self) -> tuple[list[Any], dict[sympy.Symbol, int]]: ...

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]: ...

    def unflatten_outputs(self, last_stage_outputs: Sequence[Any]) -> Any: ...

    def fill_stage_module(self, stage_index: int, device: torch.device | str | None = None, *,
                          state_dict: Any = None, seed: int = 0, strict: bool = True) -> GraphModule: ...

    def under_autocast(self, dtype: torch.dtype, device_type: str = "cpu") -> PipeView: ...
