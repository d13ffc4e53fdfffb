"""The TP hand-off at a cut, without torchtitan: a stage module holding a tensor outside any module
that shards itself is refused by name; a DTensor leaving a stage in another layout than the one
the next stage rebuilds is refused by name on that forward; a received activation becomes the
layout's DTensor with its gradient coming back whole. (Exactness under torchtitan's TP:
``test_trainer_sequence``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pippy_split.integrations.torchtitan_tensor_parallel import TensorParallelCut, parallelize_children
from pippy_split.testing import run_ranks


class _Sharded(torch.nn.Linear):
    """Stands for a torchtitan module: it answers parallelize()."""

    calls = 0

    def parallelize(self, parallel_dims: Any) -> None:
        type(self).calls += 1


def test_a_tensor_in_traced_glue_is_refused_under_tp() -> None:
    first, part = torch.nn.Module(), torch.nn.Module()
    first.tok_embeddings = _Sharded(2, 2)
    part.layers = torch.nn.ModuleDict({"0": _Sharded(2, 2)})
    TensorParallelCut.check([first, part])  # every tensor in a module that shards itself
    part.glue = torch.nn.Module()
    part.glue.register_parameter("w", torch.nn.Parameter(torch.ones(2)))
    with pytest.raises(NotImplementedError, match=r"stage 1 holds \['glue.w'\] as traced ops"):
        TensorParallelCut.check([first, part])


def test_parallelize_reaches_through_containers_and_wrappers() -> None:
    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict({"0": torch.nn.Sequential(_Sharded(2, 2)), "1": _Sharded(2, 2)})
    _Sharded.calls = 0
    parallelize_children(part, parallel_dims=None)
    assert _Sharded.calls == 2


def _hand_off(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cut = TensorParallelCut(mesh, (Shard(1),))
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3).requires_grad_()
    (y,) = cut.received((x,), [0])
    out: dict[str, Any] = {"placements": y.placements, "local": y.to_local().detach()}
    sent = cut.sent((y * 2,), 0)[0]  # whole again, a plain tensor
    sent.sum().backward()
    out["sent_is_plain"] = not isinstance(sent, DTensor)
    out["sent"], out["grad"] = sent.detach(), x.grad
    try:
        cut.sent((DTensor.from_local(x.detach(), mesh, [Replicate()]),), 3)
    except NotImplementedError as e:
        out["refusal"] = str(e)
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_received_activation_round_trips_and_a_wrong_layout_is_refused() -> None:
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    for rank, r in enumerate(run_ranks(_hand_off, 2, timeout=90)):
        assert str(r["placements"]) == "(Shard(dim=1),)"
        torch.testing.assert_close(r["local"], x.chunk(2, dim=1)[rank])
        assert r["sent_is_plain"]
        torch.testing.assert_close(r["sent"], 2 * x)
        torch.testing.assert_close(r["grad"], torch.full_like(x, 2.0))  # whole, the same on every tp rank
        assert "stage 3's output 0 is a DTensor with placements (Replicate(),)" in r["refusal"]
