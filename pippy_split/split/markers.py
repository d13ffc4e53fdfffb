"""Split markers: ``pipe_split()`` inside a model, and ``SplitPoint`` for split specs.

First step of the flow (split → Pipe → stage → schedule → runtime): these tell
the partitioner where one stage ends and the next begins.

``pipe_split()`` is a no-op in eager mode. It is a custom op with a declared side
effect, so ``torch.export`` keeps it in the graph at the exact place it was called,
even inside nested submodules.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["SplitPoint", "pipe_split", "PIPE_SPLIT_OP", "is_split_marker"]


class SplitPoint(enum.Enum):
    """Where to cut relative to a submodule named in a split spec."""

    BEGINNING = "beginning"  # the submodule starts a new stage
    END = "end"  # the stage ends right after the submodule


_lib = torch.library.Library("pippy_split", "DEF")
_lib.define("pipe_split() -> ()")


@torch.library.impl(_lib, "pipe_split", "CompositeExplicitAutograd")
def _pipe_split_impl() -> None:
    return None


@torch.library.register_fake("pippy_split::pipe_split")
def _pipe_split_fake() -> None:
    return None


PIPE_SPLIT_OP = torch.ops.pippy_split.pipe_split.default
# Without a side effect the op has no users and export's dead-code pass drops it.
torch.fx.node.has_side_effect(PIPE_SPLIT_OP)


# torch.distributed.pipelining's marker (``pippy::_pipe_split``), matched by name so that a
# model written for it splits here too without this library importing it.
_OTHER_MARKERS = frozenset({"pippy::_pipe_split"})


def is_split_marker(target: object) -> bool:
    """Whether a graph node's target is a stage-boundary marker (ours or torch's).

    Example:
        >>> is_split_marker(PIPE_SPLIT_OP), is_split_marker(torch.ops.aten.add.Tensor)
        (True, False)
    """
    if target is PIPE_SPLIT_OP:
        return True
    name = getattr(target, "name", None)
    return callable(name) and getattr(target, "namespace", None) == "pippy" and \
        name().split(".")[0] in _OTHER_MARKERS


def pipe_split() -> None:
    """Mark a stage boundary at this point of ``forward`` (no-op when run eagerly).

    Example:
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         x = self.a(x)
        ...         pipe_split()   # everything below runs in the next stage
        ...         return self.b(x)
    """
    torch.ops.pippy_split.pipe_split()
