"""DCP's save protocol over object collectives that need no numpy.

Part of :mod:`pippy_split.checkpoint`: torch's object collectives decode with
``tensor.numpy()``, and numpy is not a dependency of torch, so :class:`Comm`
exchanges pickles as uint8 tensors itself and :func:`dcp_write` runs DCP's save
steps over it.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from ..stage.groups import GroupArg, process_group


def describe_dcp_error(e: BaseException, name_ranks: bool = True) -> str:
    """DCP wraps rank failures in a CheckpointException; name the ranks and their errors.

    ``name_ranks=False`` where DCP ran in this process alone (its rank 0 is this rank)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping) and failures:
        parts = []
        for rank, err in sorted(failures.items()):
            inner = err[0] if isinstance(err, tuple) else err  # (exception, traceback summary)
            parts.append(f"{f'rank {rank}: ' if name_ranks else ''}{type(inner).__name__}: {inner}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"



class RanksFailed(Exception):
    """A step of the save failed on some ranks; raised on every rank alike.

    ``str()`` names each failed rank (where there are several) and its error;
    ``local`` is this rank's own exception, if it failed."""

    def __init__(self, failures: dict[int, str], local: BaseException | None, world: int) -> None:
        super().__init__("; ".join(f"rank {r}: {m}" if world > 1 else m for r, m in sorted(failures.items())))
        self.failures = failures
        self.local = local


def _attempt(fn) -> tuple[tuple[bool, Any], BaseException | None]:
    try:
        return (True, fn()), None
    except BaseException as e:  # DCP's own steps catch BaseException too; re-raised after the collective
        return (False, describe_dcp_error(e, name_ranks=False)), e


def dcp_write(flat: dict, directory: str, comm: "Comm") -> None:
    """``torch.distributed.checkpoint.save(flat, ...)`` into ``directory``, collectives by ``comm``.

    The same steps as DCP's ``save`` (local plans, the coordinator's global plan and
    metadata, every rank's writes, the coordinator's ``.metadata``), through the
    public ``SavePlanner`` / ``StorageWriter`` interface, but with ``comm``'s
    collectives instead of DCP's: those are torch's ``gather_object`` /
    ``scatter_object_list`` / ``broadcast_object_list``, which decode with
    ``tensor.numpy()`` and fail with ``Numpy is not available`` where numpy is not
    installed (torch does not depend on it). The files are DCP's own.
    Raises :class:`RanksFailed` on every rank when any rank fails a step.
    """
    planner = DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True)
    writer = FileSystemWriter(directory)
    coordinator = comm.rank == 0
    metadata = None

    def local_plan():
        planner.set_up_planner(state_dict=flat, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=comm.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan(plans):
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(plans)

    def write():
        writes = writer.write_data(planner.finish_plan(central), planner)
        writes.wait()
        return writes.value()

    def finish(results):
        writer.finish(metadata=metadata, results=results)

    central = _reduce(comm, local_plan, global_plan, scatter=True)
    _reduce(comm, write, finish, scatter=False)


def _reduce(comm: "Comm", local_fn, global_fn, scatter: bool) -> Any:
    """Run ``local_fn`` on every rank, ``global_fn`` on their results on rank 0, and hand
    back rank 0's answer: its ``scatter``-ed element for this rank, or the whole of it."""
    outcome, local = _attempt(local_fn)
    outcomes = comm.gather(outcome)
    reply: Any = None
    if comm.rank == 0:
        assert outcomes is not None  # gathered on rank 0
        failures = {r: v for r, (ok, v) in enumerate(outcomes) if not ok}
        if not failures:
            (ok, value), local0 = _attempt(lambda: global_fn([v for _, v in outcomes]))
            if ok:
                reply = [(True, v) for v in value] if scatter else (True, value)
            else:
                failures, local = {0: value}, local0
        if failures:
            reply = [(False, failures)] * comm.world if scatter else (False, failures)
    ok, value = comm.scatter(reply) if scatter else comm.broadcast(reply)
    if not ok:
        raise RanksFailed(value, local, comm.world)
    return value


@contextlib.contextmanager
def quiet_dcp():
    # DCP warns on every single-process call, even when asked for one with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class Comm:
    """Object collectives over the checkpoint's group (default: the default group) that need no numpy.

    torch's own (``all_gather_object`` and the like) turn the received bytes back
    into objects with ``tensor.numpy()``; numpy is not a dependency of torch, so
    on a fresh machine they fail with ``RuntimeError: Numpy is not available``.
    These pickle into a ``bytearray`` that a uint8 tensor shares
    (``torch.frombuffer``) and send that tensor, padded to the longest.
    """

    def __init__(self, no_dist: bool, group: GroupArg = None) -> None:
        self.on = (not no_dist) and dist.is_available() and dist.is_initialized()
        self.group = process_group(group, "checkpoint") if self.on else None
        self.rank = dist.get_rank(self.group) if self.on else 0
        self.world = dist.get_world_size(self.group) if self.on else 1

    def _device(self) -> torch.device:
        """Where the group's collectives take tensors: the CPU unless the only backend is a device's."""
        backend = str(dist.get_backend(self.group))
        if backend in ("gloo", "mpi") or "cpu:" in backend:  # "cpu:gloo,cuda:nccl": the CPU one
            return torch.device("cpu")
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return torch.device("cpu") if acc is None else torch.device(acc.type, torch.accelerator.current_device_index())

    @staticmethod
    def _decode(tensor: torch.Tensor, size: int) -> Any:
        buf = bytearray(size)
        torch.frombuffer(buf, dtype=torch.uint8).copy_(tensor[:size])
        return pickle.loads(buf)

    def _encode(self, obj: Any) -> tuple[bytes, list[int], torch.device]:
        """This rank's pickle, every rank's size (one all_gather), the device to send on."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        device = self._device()
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=self.group)
        return data, [int(n.item()) for n in sizes], device

    @staticmethod
    def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
        buf = bytearray(size)
        buf[:len(data)] = data
        return torch.frombuffer(buf, dtype=torch.uint8).to(device)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        data, sizes, device = self._encode(obj)
        longest = max(sizes)
        out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world)]
        dist.all_gather(out, self._padded(data, longest, device), group=self.group)
        return [self._decode(t, n) for t, n in zip(out, sizes)]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        data, sizes, device = self._encode(obj)
        longest = max(sizes)
        out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world)]
        dist.gather(self._padded(data, longest, device), out if self.rank == 0 else None, group=self.group,
                    group_dst=0)
        return [self._decode(t, n) for t, n in zip(out, sizes)] if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        device = self._device()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, group=self.group, group_src=0)
        payload = self._padded(data, int(size.item()), device)
        dist.broadcast(payload, group=self.group, group_src=0)
        return self._decode(payload, int(size.item()))

    def scatter(self, objs: list[Any] | None) -> Any:
        """Element ``rank`` of rank 0's list, on each rank."""
        if self.world == 1:
            assert objs is not None  # a single rank is rank 0
            return objs[0]
        return self.broadcast(objs)[self.rank]

