"""Rank bodies of the generation tests on FSDP2 / TP stages (top-level so they pickle).

Each body builds an HF Llama's traced stages (``LAYERS`` blocks) on a 2 x 2 DeviceMesh,
shards them with torch's own ``fully_shard`` / ``parallelize_module`` (through
``ps.parallelize``), generates, trains one SGD step, generates again, and reports what each
call gathered. ``group`` (from :func:`~.gen_bodies.cases_body`) is not used: each body builds
its own mesh."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

import pippy_split as ps
from pippy_split.zoo import layer_split

from .gen_bodies import LR, N_MB, llama, lm_loss, train_batch
from .models import prompts

LAYERS = 4  # two stages of two blocks; four of one under V


def tp_plan() -> dict:
    """Megatron-style TP for HF Llama's decoder layers: q/k/v, gate/up column-wise,
    o/down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {f"model.layers.*.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"model.layers.*.mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
    plan.update({"model.layers.*.self_attn.o_proj": RowwiseParallel(),
                 "model.layers.*.mlp.down_proj": RowwiseParallel()})
    return plan


def _spy_gathers() -> list:
    """Every :class:`~pippy_split.generate.gathered.Gathered` this rank's generate() calls make."""
    import pippy_split.generate.distributed as gd

    seen: list = []
    real = gd.unsharded_stages

    @contextlib.contextmanager
    def spy(*args: Any) -> Iterator[Any]:
        with real(*args) as g:
            seen.append(g)
            yield g

    gd.unsharded_stages = spy  # type: ignore[assignment]
    return seen


def _state(sched: Any) -> tuple[list[int], int, int]:
    """The stages' parameter objects, how many are DTensors, and their forward hooks."""
    from torch.distributed.tensor import DTensor

    params = [p for st in sched.stages for p in st.module.parameters()]
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for st in sched.stages for m in st.module.modules())
    return [id(p) for p in params], sum(isinstance(p, DTensor) for p in params), hooks


def _generate_train_generate(sched: Any, ids: torch.Tensor, target: torch.Tensor, kwargs: dict) -> dict:
    seen = _spy_gathers()
    prompt, mask = prompts(True, batch=5)
    prompt = prompt % 64
    state = _state(sched)
    before = sched.generate(prompt, attention_mask=mask, return_logprobs=True, **kwargs)
    kept = _state(sched) == state  # the same parameter objects, still sharded, hooks back
    opt = torch.optim.SGD([p for st in sched.stages for p in st.module.parameters()], lr=LR)
    sched.step(ids, target=target)
    opt.step()
    opt.zero_grad()
    after = sched.generate(prompt, attention_mask=mask, return_logprobs=True, **kwargs)
    return {"before": (before.sequences, before.logprobs), "after": (after.sequences, after.logprobs),
            "kept": kept and _state(sched) == state, "sharded": state[1],
            "gathered": [(g.tensors, g.numel) for g in seen], "freed": all(g.freed() for g in seen)}


def fsdp_body(rank: int, world: int, kwargs: dict, schedule: str = "1F1B", stages: int = 2,
              group: Any = None) -> dict:
    """(dp=2, pp=2): per-block FSDP2 (``model.layers.*``, then each stage root) over
    ``mesh["dp"]``; each replica trains on its half of the batch. Under a V schedule each
    rank holds two stages, gathered in the order of ``sched.stages``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    ids, target = train_batch()
    half = slice(2 * mesh.get_local_rank("dp"), 2 * mesh.get_local_rank("dp") + 2)
    pipe = ps.pipeline(llama(LAYERS), layer_split("model.layers", LAYERS, stages), (ids[:1],))
    sched = ps.build_schedule(pipe, schedule, N_MB // 2, loss_fn=lm_loss, group=mesh["pp"])
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["model.layers.*"])
    return _generate_train_generate(sched, ids[half], target[half], kwargs)


def tp_body(rank: int, world: int, kwargs: dict, group: Any = None) -> dict:
    """(pp=2, tp=2): the decoder layers' linears tensor-parallel over ``mesh["tp"]``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    ids, target = train_batch()
    pipe = ps.pipeline(llama(LAYERS), layer_split("model.layers", LAYERS, 2), (ids[:1],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=lm_loss, group=mesh["pp"])
    ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan=tp_plan())
    return _generate_train_generate(sched, ids, target, kwargs)


def fsdp_tp_body(rank: int, world: int, kwargs: dict, group: Any = None) -> dict:
    """(pp=1, dp=2, tp=2): TP over ``mesh["tp"]`` and per-block FSDP2 over ``mesh["dp"]`` on
    one stage: 2-D DTensors (Shard on dp and on tp) made whole by one ``full_tensor`` each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    ids, target = train_batch()
    half = slice(2 * mesh.get_local_rank("dp"), 2 * mesh.get_local_rank("dp") + 2)
    pipe = ps.pipeline(llama(LAYERS), layer_split("model.layers", LAYERS, 1), (ids[:1],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB // 2, loss_fn=lm_loss, group=mesh["pp"])
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["model.layers.*"], tp_mesh=mesh["tp"], tp_plan=tp_plan())
    return _generate_train_generate(sched, ids[half], target[half], kwargs)


def failing_generate_body(rank: int, world: int) -> dict:
    """One rank, TP and per-block FSDP2 on a 1 x 1 mesh: a decode step that raises mid-call
    leaves the stage as it was (shards, parameter objects, hooks) and frees what the call
    gathered; the next call gives what the unsharded pipe gave."""
    from torch.distributed.device_mesh import init_device_mesh

    from pippy_split.generate.stage_step import StageDecoder

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    ids, _ = train_batch()
    pipe = ps.pipeline(llama(LAYERS), layer_split("model.layers", LAYERS, 1), (ids[:1],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=lm_loss)
    prompt, mask = prompts(True, batch=3)
    prompt = prompt % 64
    want = pipe.generate(prompt, attention_mask=mask, max_new_tokens=3)
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["model.layers.*"], tp_mesh=mesh["tp"], tp_plan=tp_plan())
    seen = _spy_gathers()
    state = _state(sched)
    original = StageDecoder.run

    def run(self: StageDecoder, *args: Any) -> Any:
        raise RuntimeError("injected failure")

    StageDecoder.run = run  # type: ignore[method-assign]
    try:
        sched.generate(prompt, attention_mask=mask, max_new_tokens=3)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        StageDecoder.run = original  # type: ignore[method-assign]
    kept, freed = _state(sched) == state, seen[0].freed()
    got = sched.generate(prompt, attention_mask=mask, max_new_tokens=3)
    return {"error": error, "kept": kept, "sharded": state[1], "freed": freed,
            "same": torch.equal(got.sequences, want.sequences)}
