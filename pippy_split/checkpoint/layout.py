"""The on-disk key layout of a pippy_split checkpoint, its error, and the key reports.

Part of :mod:`pippy_split.checkpoint` (which users import); see its docstring for
the layout and the guarantees.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]

FORMAT_VERSION = 1
MODEL_PREFIX = "model."
STATE_PREFIX = "optim.state."
GROUPS_PREFIX = "optim.param_groups."
OPTIM_PREFIX = "optim."
EXTRA_KEY = "extra"
INFO_KEY = "pippy_split"
METADATA_FILE = ".metadata"  # written by DCP last, once every rank has written its data
_SHOW = 10  # keys listed per kind in an error message


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, or matched to the model.

    Attributes:
        path: the checkpoint directory.
        missing: keys the model (or optimizer) needs that the checkpoint lacks.
        unexpected: model keys the checkpoint holds that no given module has.
    """

    def __init__(self, message: str, path: str = "", missing: list[str] | None = None,
                 unexpected: list[str] | None = None):
        super().__init__(message)
        self.path = path
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])



def raise_any(errors: list, prefix: str, path: str) -> None:
    """Raise on every rank alike when any rank found a problem (so that no rank hangs).

    ``errors`` is one message or None per rank; ranks with the same message are named together.
    """
    by_message: dict[str, list[int]] = {}
    for rank, e in enumerate(errors):
        if e is not None:
            by_message.setdefault(e, []).append(rank)
    if not by_message:
        return
    if len(errors) == 1:
        raise CheckpointError(prefix + next(iter(by_message)), path)
    parts = [f"{m} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for m, r in by_message.items()]
    raise CheckpointError(prefix + "; ".join(parts), path)


def show_keys(keys: list[str]) -> str:
    more = f" ... and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


def key_report(path: str, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"checkpoint {path} does not match the model"]
    if missing:
        parts.append(f"{len(missing)} missing keys (needed, not in the checkpoint): {show_keys(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (in the checkpoint, in no given module): {show_keys(unexpected)}")
    return "; ".join(parts)


