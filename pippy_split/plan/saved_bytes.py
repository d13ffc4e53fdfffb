"""A counter of the bytes autograd holds for backward: each saved storage once, while it lives.

Used by the planner's stage measurement (:mod:`.measure`) and by the benchmarks that
check it. RSS cannot show activation memory on CPU (the allocator keeps freed pages);
counting the storages packed through ``saved_tensors_hooks`` can, on any device.
"""

from __future__ import annotations

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """Live bytes of the storages autograd saves (each storage once), and their peak.

    ``skip``: data pointers of storages not to count (the parameters).

    Example:
        >>> counter = SavedBytes(set())
        >>> x = torch.ones(256, requires_grad=True)
        >>> with counter.hooks():
        ...     y = (x * x).sum()
        >>> counter.live, counter.peak
        (1024, 1024)
        >>> del y; counter.live
        0
    """

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> "_Held":
        return _Held(self, t)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda held: held.t)

    def take_peak(self) -> int:
        """The peak since the last call (or since the start); the peak restarts from now."""
        peak, self.peak = self.peak, self.live
        return peak


class _Held:
    __slots__ = ("owner", "t", "ptr")

    def __init__(self, owner: SavedBytes, t: torch.Tensor) -> None:
        # detached: holding t itself would tie the graph node that saved it (t.grad_fn) into a cycle
        # through this object, and a graph the I/W split retains would never be freed
        self.owner, self.t = owner, t.detach()
        storage = t.untyped_storage()
        self.ptr: int | None = storage.data_ptr()
        if self.ptr in owner.skip:
            self.ptr = None
            return
        owner.refs[self.ptr] = owner.refs.get(self.ptr, 0) + 1
        if owner.refs[self.ptr] == 1:
            owner.sizes[self.ptr] = storage.nbytes()
            owner.live += storage.nbytes()
            owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        o, ptr = self.owner, self.ptr
        if ptr is not None:
            o.refs[ptr] -= 1
            if o.refs[ptr] == 0:
                del o.refs[ptr]
                o.live -= o.sizes.pop(ptr)
