"""What ``pipeline_llm`` cannot do is refused by name before anything is traced or built: context
parallelism, TP outside torchtitan's ``partial_dtensor`` backend, a CSV schedule, tied embeddings.
No torchtitan needed (its configs are read by attribute only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pippy_split.integrations.torchtitan import pipeline_llm


class _Dims(SimpleNamespace):
    def get_mesh(self, name: str) -> None:
        raise AssertionError("pipeline_llm got as far as the mesh")


def _call(model: torch.nn.Module | None = None, tp: bool = False, csv: str = "", cp: bool = False,
          backend: str = "partial_dtensor") -> None:
    parallelism = SimpleNamespace(pipeline_parallel_schedule="1F1B", pipeline_parallel_schedule_csv=csv,
                                  pipeline_parallel_degree=2, pipeline_parallel_microbatch_size=1, spmd_backend=backend)
    pipeline_llm(model or torch.nn.Linear(2, 2), parallel_dims=_Dims(tp_enabled=tp, cp_enabled=cp),
                 training=SimpleNamespace(local_batch_size=2, seq_len=4), parallelism=parallelism,
                 compile_config=None, ac_config=None, dump_folder="/tmp", device=torch.device("cpu"),
                 model_config=None, parallelize_fn=lambda m, **kw: m, loss_fn=lambda *a, **k: (0, {}))


def test_context_parallelism_is_refused_with_what_works():
    with pytest.raises(NotImplementedError, match=r"context parallelism \(cp > 1\).*What works: pp x tp x FSDP2"):
        _call(cp=True)


@pytest.mark.parametrize("backend", ["full_dtensor", "spmd_types"])
def test_tensor_parallelism_outside_partial_dtensor_is_refused(backend):
    with pytest.raises(NotImplementedError, match=f"spmd_backend='{backend}'.*What works: tp with "
                                                  "spmd_backend='partial_dtensor'"):
        _call(tp=True, backend=backend)


def test_a_csv_schedule_is_refused():
    with pytest.raises(NotImplementedError, match="pipeline_parallel_schedule_csv"):
        _call(csv="order.csv")


def test_tied_embeddings_are_refused():
    model = torch.nn.Linear(2, 2)
    model.enable_weight_tying = True
    with pytest.raises(NotImplementedError, match="enable_weight_tying=True is not supported.*counting a weight two parts hold twice"):
        _call(model)
