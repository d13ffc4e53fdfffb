"""Point-to-point transport between ranks of one process group.

Sits under the runtime: the interpreter asks it to send/receive one tensor of
one edge for one microbatch. Tags make every message unique, so sends never
block (``isend``) and receives match exactly their sender. Complex tensors go
as real views. Every wait has a timeout whose error says what was awaited.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import PipelineError, PipelineTimeout

__all__ = ["P2P", "message_tag", "Pending"]

MAX_INPUTS = 1024  # per-stage input slots addressable by a tag


def message_tag(mb: int, dst_stage: int, dst_input: int, num_stages: int, backward: bool) -> int:
    """A tag unique to (microbatch, receiving slot, direction), known to both sides."""
    return ((mb * num_stages + dst_stage) * MAX_INPUTS + dst_input) * 2 + int(backward)


@dataclass(eq=False)
class Pending:
    work: Any
    what: str  # "stage 2 waiting for the forward of microbatch 5 from stage 0 on rank 0"
    buffer: torch.Tensor | None = None
    complex_dtype: torch.dtype | None = None

    def result(self) -> torch.Tensor | None:
        if self.buffer is None:
            return None
        if self.complex_dtype is not None:
            return torch.view_as_complex(self.buffer)
        return self.buffer


class P2P:
    """isend/irecv over ``group`` with group-local ranks and a timeout on every wait."""

    def __init__(self, group: Any = None, timeout: float = 300.0) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout)
        self.timeout_s = timeout

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Pending:
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        tensor = tensor.detach().contiguous()
        try:
            work = dist.isend(tensor, group=self.group, group_dst=peer, tag=tag)
        except Exception as e:
            raise PipelineError(f"{what}: send failed: {e}") from e
        return Pending(work, what, tensor)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, peer: int, tag: int,
             what: str) -> Pending:
        complex_dtype = dtype if dtype.is_complex else None
        if complex_dtype is not None:
            buf = torch.empty((*shape, 2), dtype=torch.empty((), dtype=dtype).real.dtype, device=device)
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        try:
            work = dist.irecv(buf, group=self.group, group_src=peer, tag=tag)
        except Exception as e:
            raise PipelineError(f"{what}: receive failed: {e}") from e
        return Pending(work, what, buf, complex_dtype)

    def wait(self, pending: Pending) -> None:
        try:
            ok = pending.work.wait(self.timeout)
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "timed out" in msg.lower() or "timeout" in msg.lower():
                raise PipelineTimeout(f"{pending.what}: no message within {self.timeout_s:.0f} s ({msg})") from e
            raise PipelineError(f"{pending.what}: the peer failed or went away ({msg})") from e
        if ok is False:
            raise PipelineTimeout(f"{pending.what}: no message within {self.timeout_s:.0f} s")
