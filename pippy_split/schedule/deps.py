"""Dependency rules between compute actions (F, B, I, W) of a pipeline.

Sits under the schedule layer: order generators, the simulator and the
validator all ask here what must finish before an action may start, so that
the rule lives in one place. Stages talk through *links*:

``Link = (src_stage, dst_stage, carries_grad)``: the forward output of
``src`` feeds ``dst``; when ``carries_grad`` is true, ``dst``'s input-gradient
backward (``B`` or ``I``) sends a gradient back to ``src``. The default linear
chain is ``s -> s + 1`` with gradients; skip connections add more links.

A requirement is returned as an :class:`Action`. A required ``I`` is met by
either ``I`` or ``B`` of the same ``(stage, mb)`` (``B`` = ``I`` + ``W``), so
one rule serves orders with and without a split backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from .actions import Action, ActionKind

if TYPE_CHECKING:
    from ..split.spec import Edge

__all__ = ["Link", "DepIndex", "chain_links", "edge_links", "compute_deps", "deps_function", "satisfies"]

Link = tuple[int, int, bool]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def chain_links(num_stages: int) -> list[Link]:
    """The default linear pipeline: ``s -> s + 1`` for every stage, with gradients.

    Example:
        >>> chain_links(3)
        [(0, 1, True), (1, 2, True)]
    """
    return [(s, s + 1, True) for s in range(num_stages - 1)]


def edge_links(edges: Iterable[Edge]) -> list[Link]:
    """The links of a Pipe's edges: one per (sending stage, receiving stage), carrying a
    gradient when any edge between the two does (a model input sent on carries none)."""
    out: dict[tuple[int, int], bool] = {}
    for e in edges:
        key = (e.sender_stage, e.dst_stage)
        out[key] = out.get(key, False) or (e.spec.carries_grad and not e.from_input)
    return [(s, d, g) for (s, d), g in sorted(out.items())]


class DepIndex:
    """``links`` indexed by stage, for answering many dependency questions fast.

    ``preds[s]`` are the stages feeding ``s``; ``grad_succs[s]`` the stages that
    send a gradient back to ``s``. :meth:`keys` is the tuple-level rule that
    :func:`compute_deps` and the simulator share.
    """

    def __init__(self, links: Iterable[Link], num_stages: int) -> None:
        self.num_stages = num_stages
        self.preds: list[list[int]] = [[] for _ in range(num_stages)]
        self.grad_succs: list[list[int]] = [[] for _ in range(num_stages)]
        for src, dst, carries_grad in links:
            if not (0 <= src < num_stages and 0 <= dst < num_stages):
                raise ValueError(f"link ({src} -> {dst}) names a stage outside [0, {num_stages})")
            self.preds[dst].append(src)
            if carries_grad:
                self.grad_succs[src].append(dst)

    def keys(self, stage: int, kind: ActionKind, mb: int) -> list[tuple[int, ActionKind, int]]:
        """Requirements of ``(stage, kind, mb)`` as ``(stage, kind, mb)`` tuples."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"action {stage}{kind.value}{mb} names stage {stage}, outside [0, {self.num_stages})")
        if kind is F:
            return [(src, F, mb) for src in self.preds[stage]]
        if kind is B or kind is I:
            # The gradient w.r.t. this stage's outputs comes from every consumer
            # that sends one back; a stage with none (the last) needs only its F.
            return [(stage, F, mb)] + [(dst, I, mb) for dst in self.grad_succs[stage]]
        if kind is W:
            return [(stage, I, mb)]
        raise ValueError(f"{stage}{kind.value}{mb} is not a compute action (F, B, I, W)")

    def deps(self, action: Action) -> list[Action]:
        """Requirements of ``action`` as :class:`Action` objects."""
        return [Action(s, k, mb) for s, k, mb in self.keys(action.stage, action.kind, action.mb)]


def deps_function(links: Iterable[Link], num_stages: int) -> Callable[[Action], list[Action]]:
    """Index ``links`` once and return a fast ``action -> requirements`` function."""
    return DepIndex(links, num_stages).deps


def compute_deps(action: Action, links: Iterable[Link], num_stages: int) -> list[Action]:
    """Compute actions that must have completed before ``action`` may start.

    Rules: ``F(s, mb)`` needs ``F(src, mb)`` for every link into ``s``;
    ``B(s, mb)`` and ``I(s, mb)`` need ``F(s, mb)`` and ``I(dst, mb)`` for every
    grad-carrying link out of ``s``; ``W(s, mb)`` needs ``I(s, mb)``. A required
    ``I`` is met by ``B`` too (see :func:`satisfies`).

    Args:
        action: a compute action.
        links: ``(src_stage, dst_stage, carries_grad)`` triples.
        num_stages: total stages in the pipeline.

    Returns:
        The required actions.

    Example:
        >>> compute_deps(Action(1, ActionKind.B, 0), chain_links(4), 4)
        [Action(1F0), Action(2I0)]
    """
    return deps_function(links, num_stages)(action)


def satisfies(done: Action, required: Action) -> bool:
    """Whether completing ``done`` meets requirement ``required`` (``B`` meets ``I``)."""
    if (done.stage, done.mb) != (required.stage, required.mb):
        return False
    return done.kind is required.kind or (done.kind is B and required.kind is I)
