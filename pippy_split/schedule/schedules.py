"""The schedule classes, written out: one per order family, plus ``ScheduleFromOrder``.

Sits at the top of the schedule layer, over :class:`~.pipeline_schedule.PipelineSchedule`
(which does the work). Each class names its family in :data:`.orders.ORDERS`
(``order_name``) and the placement that family needs (``placement_style``); its
docstring cites the paper and shows the timeline the family produces on 2 ranks (unit
costs, ``B`` = ``I`` + ``W`` = 2). :func:`get_schedule_class` finds a class by the
registry's names; :func:`build_schedule` builds this rank's stages of a Pipe for one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..stage.groups import GroupArg, PipelineGroup
from ..stage.options import StageOptions
from ..stage.stage import PipelineStage
from .actions import Order, order_from_csv
from .errors import ScheduleError
from .orders import get_order_spec
from .pipeline_schedule import PipelineSchedule
from .placement import replace_placement
from .schedule_plan import SchedulePlan
from .simulate import simulate  # noqa: F401 - the class docstrings' timelines run it
from .timing import ActionTiming
from .train_mode import train_mode_ops

if TYPE_CHECKING:
    from ..split.pipe import Pipe

__all__ = ["PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleFromOrder", "ActionTiming",
           "replace_placement", "train_mode_ops", "get_schedule_class", "build_schedule"]


class ScheduleGPipe(PipelineSchedule):
    """GPipe: every microbatch's forward, then every backward; each rank holds all
    ``n_microbatches`` activations at its peak.

    Stages: exactly 1 stage per rank (stages = ranks); loop placement. From Huang et al.
    2019, GPipe (NeurIPS).

        >>> print(simulate(ScheduleGPipe.compute_order(2, 3)))
        2 ranks, makespan 12, bubble 25.0%
                0       2       4       6       8       10      12
        rank 0 |0F0 0F1 0F2 ............0B0     0B1     0B2     |
        rank 1 |....1F0 1F1 1F2 1B0     1B1     1B2     ........|
        peak activations: r0=3 r1=3
    """

    order_name = "GPipe"
    placement_style = "loop"


class Schedule1F1B(PipelineSchedule):
    """1F1B: after a warm-up of forwards each rank alternates one forward and one backward,
    so rank ``r`` of ``p`` holds at most ``p - r`` activations.

    Stages: exactly 1 stage per rank (stages = ranks); loop placement. From Narayanan et
    al. 2021, PipeDream-Flush (ICML).

        >>> print(simulate(Schedule1F1B.compute_order(2, 3)))
        2 ranks, makespan 12, bubble 25.0%
                0       2       4       6       8       10      12
        rank 0 |0F0 0F1 ........0B0     0F2 0B1     ....0B2     |
        rank 1 |....1F0 1B0     1F1 1B1     1F2 1B2     ........|
        peak activations: r0=2 r1=1
    """

    order_name = "1F1B"
    placement_style = "loop"


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: 1F1B over several stage chunks per rank (rank ``r`` holds ``r, r +
    p, ...``): the warm-up bubble shrinks with the number of chunks, for more messages.

    Stages: 2 or more stages per rank, the same on every rank (stages a multiple of ranks);
    loop placement. From Narayanan et al. 2021, Megatron-LM (SC).

        >>> print(simulate(ScheduleInterleaved1F1B.compute_order(2, 2)))
        2 ranks, makespan 15, bubble 20.0%
                0       2       4       6       8       10      12      14
        rank 0 |0F0 0F1 2F0 2F1 ........2B0     ....2B1     0B0     0B1     |
        rank 1 |....1F0 1F1 3F0 3B0     3F1 3B1     1B0     1B1     ........|
        peak activations: r0=4 r1=3
    """

    order_name = "Interleaved1F1B"
    placement_style = "loop"


class ScheduleLoopedBFS(PipelineSchedule):
    """Breadth-first looped: each chunk runs every microbatch's forward before the next
    chunk does, the backwards in reverse.

    Stages: 1 or more stages per rank, the same on every rank (stages a multiple of ranks);
    loop placement. From Lamy-Poirier 2023, Breadth-First Pipeline Parallelism.

        >>> print(simulate(ScheduleLoopedBFS.compute_order(2, 2, 2)))
        2 ranks, makespan 15, bubble 20.0%
                0       2       4       6       8       10      12      14
        rank 0 |0F0 0F1 2F0 2F1 ............2B1     2B0     0B1     0B0     |
        rank 1 |....1F0 1F1 3F0 3F1 3B1     3B0     1B1     1B0     ........|
        peak activations: r0=4 r1=4
    """

    order_name = "LoopedBFS"
    placement_style = "loop"


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """Zero bubble (ZB-H1): each backward is split into I (the input gradient, which the
    previous stage waits for) and W (the weight gradient, which fills the bubbles).

    Stages: 1 or more stages per rank, the same on every rank (stages a multiple of ranks);
    loop placement. From Qi et al. 2024, Zero Bubble Pipeline Parallelism (ICLR), ZB-H1.

        >>> print(simulate(ScheduleInterleavedZeroBubble.compute_order(2, 3)))
        2 ranks, makespan 10, bubble 10.0%
                0       2       4       6       8       10
        rank 0 |0F0 0F1 ....0I0 0W0 0F2 0I1 0W1 0I2 0W2 |
        rank 1 |....1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2 |
        peak activations: r0=2 r1=2
    """

    order_name = "InterleavedZeroBubble"
    placement_style = "loop"


class ScheduleZBVZeroBubble(PipelineSchedule):
    """ZB-V: rank ``r`` of ``p`` holds stages ``r`` and ``2p - 1 - r`` (the first and the
    last stage share rank 0), each backward split into I and W.

    Stages: exactly 2 stages per rank (stages = 2 x ranks); v placement. From Qi et al.
    2024, Zero Bubble Pipeline Parallelism (ICLR), ZB-V.

        >>> print(simulate(ScheduleZBVZeroBubble.compute_order(2, 2)))
        2 ranks, makespan 13, bubble 7.7%
                0       2       4       6       8       10      12
        rank 0 |0F0 0F1 ....3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0W1 |
        rank 1 |....1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1 |
        peak activations: r0=4 r1=4
    """

    order_name = "ZBVZeroBubble"
    placement_style = "v"


class ScheduleDualPipeV(PipelineSchedule):
    """DualPipeV: DualPipe folded onto the V: the forward of one microbatch runs beside the
    full backward of another, and the last backwards split into I and W to fill the tail.

    Stages: exactly 2 stages per rank (stages = 2 x ranks); v placement. From DeepSeek-AI
    2024, DeepSeek-V3 Technical Report (DualPipe).

        >>> print(simulate(ScheduleDualPipeV.compute_order(2, 3)))
        2 ranks, makespan 19, bubble 5.3%
                0       2       4       6       8       10      12      14      16      18
        rank 0 |0F0 0F1 0F2 3F0 3I0 3W0 3F1 3B1     3F2 ....0B0     3B2     0I1 0W1 0I2 0W2 |
        rank 1 |....1F0 2F0 1F1 2F1 1F2 2B0     2F2 1B0     2B1     1B1     2I2 1I2 2W2 1W2 |
        peak activations: r0=4 r1=5
    """

    order_name = "DualPipeV"
    placement_style = "v"


class ScheduleFromOrder(PipelineSchedule):
    """Run a hand-written order (an ``{rank: [Action | None]}`` dict or a CSV path/text).

    The placement is read off the order. The order is validated (every F and backward
    once, dependencies, a dry run with the comms) on every rank before anything runs,
    so a bad order is a :class:`ScheduleError` at construction, never a hang.

    Example (one CSV row per rank; here one rank holds both stages):
        >>> import pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> pipe = ps.pipeline(model, ["2"], (torch.randn(2, 4),))  # 2 stages, here on one rank
        >>> order = order_from_csv("0F0,1F0,1B0,0F1,1F1,0B0,1B1,0B1")
        >>> stages = [pipe.build_stage(i, "cpu") for i in range(2)]
        >>> sched = ScheduleFromOrder(stages, 2, torch.nn.functional.mse_loss, order=order)
        >>> sched.step(torch.randn(4, 4), target=torch.randn(4, 2)).shape
        torch.Size([4, 2])
    """

    def __init__(self, stage_or_stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, order: Order | str | Path, **kwargs: Any) -> None:
        self._given_order = order_from_csv(order) if isinstance(order, (str, Path)) else order
        super().__init__(stage_or_stages, n_microbatches, loss_fn, **kwargs)

    def _make_plan(self) -> SchedulePlan:
        order = {int(r): list(acts) for r, acts in self._given_order.items()}
        if sorted(order) != list(range(self.world)):
            raise ScheduleError(f"the order has rows for ranks {sorted(order)} but the group has {self.world} ranks")
        return SchedulePlan.of_order(order, None, self.n_microbatches, self.links)

    @property
    def placement_name(self) -> str:
        """``"from order"``: the placement is read off the order."""
        return "from order"


_CLASSES: dict[str, type[PipelineSchedule]] = {
    c.order_name: c for c in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)}
"""The class of each family in :data:`.orders.ORDERS`, by the registry's own name."""


def get_schedule_class(name: str) -> type[PipelineSchedule]:
    """The schedule class for a name (case-insensitive, ``Schedule`` prefix optional):
    "GPipe", "1F1B", "ZBVZeroBubble", ... The names are those of :data:`.orders.ORDERS`
    (looked up by :func:`.orders.get_order_spec`).

    Example:
        >>> get_schedule_class("zbvzerobubble").__name__
        'ScheduleZBVZeroBubble'
    """
    return _CLASSES[get_order_spec(name).name]


def build_schedule(pipe: Pipe, name_or_class: str | type[PipelineSchedule], n_microbatches: int,
                   loss_fn: Callable | None = None, group: GroupArg = None,
                   device: torch.device | str | None = None, *,
                   activation_checkpoint: str | Sequence[str] | None = None,
                   mixed_precision: torch.dtype | None = None,
                   compile: bool | Mapping[str, Any] = False, state_dict: Any = None, **kwargs: Any) -> PipelineSchedule:
    """Build this rank's stages of ``pipe`` with the schedule's placement and return the schedule.

    ``activation_checkpoint`` (``None``, ``"full"``, or module FQN patterns such as
    ``["blocks.*"]`` for selective checkpointing), ``mixed_precision`` (``None``,
    ``torch.bfloat16``, ``torch.float16``) and ``compile`` (``torch.compile`` each stage,
    zero-bubble I/W split included) go to every stage, and ``state_dict`` (values by original
    FQN, e.g. a lazily read pretrained directory) fills the stages of a pipe traced on
    ``meta``, each rank reading only its own stages' keys; other keywords go to the schedule
    class (``loss_count=``, ``placement=``, ...). ``group`` is the pipeline's process
    group or one dimension of a DeviceMesh (``mesh["pp"]``).

    Example (on each rank of a group, the same call builds that rank's stages):
        >>> import pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> pipe = ps.pipeline(model, ["2"], (torch.randn(2, 4),))  # 2 stages, here on one rank
        >>> sched = build_schedule(pipe, "ZBVZeroBubble", 8, loss_fn=torch.nn.functional.mse_loss,
        ...                        activation_checkpoint="full")
        >>> _ = sched.step(torch.randn(16, 4), target=torch.randn(16, 2))
        >>> sched.loss.shape, [st.stage_index for st in sched.stages]
        (torch.Size([]), [0, 1])
    """
    cls = get_schedule_class(name_or_class) if isinstance(name_or_class, str) else name_or_class
    pg = PipelineGroup.of(group, where="build_schedule")
    rank, world = pg.rank, pg.world
    spec = get_order_spec(cls.order_name)
    if not spec.fits(pipe.num_stages, world):
        raise ValueError(f"{pipe.num_stages} stages on {world} rank{'s' if world > 1 else ''}: {cls.__name__} needs "
                         f"{spec.stage_rule()}. What would work: {spec.nearest(pipe.num_stages, world)}")
    where = cls.stage_placement(pipe.num_stages, world, kwargs.get("placement"))
    mine = sorted(s for s, r in where.items() if r == rank)
    options = StageOptions.of(activation_checkpoint, mixed_precision, compile, where="build_schedule")
    stages = [pipe.build_stage(s, device, pg.group, state_dict=state_dict, options=options) for s in mine]
    return cls(stages, n_microbatches, loss_fn, **kwargs)
