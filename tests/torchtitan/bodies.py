"""Rank bodies: torchtitan's Trainer sequence replayed on gloo ranks, and its unsplit reference.

The sequence is the one ``torchtitan.trainer.Trainer`` (0.3.0) runs with pipeline parallelism:
the model built on ``meta``; ``model_spec.pipelining_fn(model, parallel_dims=, training=, ...)``
(pippy_split's ``pipeline_llm`` or torchtitan's own through the compat route); ``to_empty``,
``init_weights(buffer_device=None)`` and ``train()`` on every part; an optimizer over the parts;
per step ``zero_grad``, ``pp_schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=,
loss_kwargs={"global_valid_tokens": ...}, return_outputs=False)``, ``dist_utils.clip_grad_norm_``
with the ``pp`` mesh, ``optimizers.step()``; then, where asked, ``sched.generate`` on the
trained stages (:func:`generated`). The Trainer itself has no CPU path, so its calls
are made here one by one. Weights are then set to the reference's (a seed checkpoint would do
the same) so the run can be compared with the unsplit model.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.distributed.pipeline_parallel import pipeline_llm as tt_pipeline_llm
from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.qwen3 import parallelize_qwen3

from pippy_split.integrations.torchtitan import pipeline_llm
from pippy_split.integrations.torchtitan_compat import compat_pipeline_llm

from .models import VOCAB, config

PARALLELIZE = {"llama3": parallelize_llama, "qwen3": parallelize_qwen3, "deepseek_v3": parallelize_deepseekv3}
ROUTES = {"pipeline_llm": pipeline_llm, "compat": compat_pipeline_llm}
BATCH, SEQ, STEPS, LR, MAX_NORM = 4, 8, 2, 0.05, 1.0
GEN_NEW = 5  # tokens generate() adds to each prompt of :func:`gen_prompts`
CASE_TIMEOUT_S = 300


def batches(dp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global (tokens, labels) of each optimizer step, (dp * BATCH, SEQ) each; data-parallel
    rank d reads rows d * BATCH to (d + 1) * BATCH, as the Trainer's dataloader shards the batch."""
    g = torch.Generator().manual_seed(7)
    shape = (dp * BATCH, SEQ)
    return [(torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g))
            for _ in range(STEPS)]


def reference_model(name: str, n_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = config(name, n_layers).build()
    model.init_weights()
    return model


def counters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The MoE load counters (``tokens_per_expert``) a module holds, by FQN."""
    return {_fqn(n): _full(b) for n, b in module.named_buffers() if "tokens_per_expert" in n}


def gen_prompts() -> torch.Tensor:
    """The prompts ``generate`` continues on the trained stages: 3 rows of one length (the model
    reads no mask)."""
    return torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(11))


def greedy_reference(model: torch.nn.Module, prompts: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain greedy loop over ``model``'s full forward of the growing sequence: (sequences,
    log-probabilities of the chosen tokens)."""
    seq, logprobs = prompts, []
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(seq)[:, -1].float()
            token = logits.argmax(-1)
            logprobs.append(torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0])
            seq = torch.cat([seq, token[:, None]], dim=1)
    return seq, torch.stack(logprobs, dim=1)


def generated(sched: Any, parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """``sched.generate`` on the trained parts, in eval mode as torchtitan's Validator runs its
    forwards (a MoE in train mode would count the decoded tokens in ``tokens_per_expert``), after
    a call with left-padded prompts that every rank refuses (its message kept)."""
    from pippy_split.generate import GenerationError

    prompts = gen_prompts()
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    try:
        sched.generate(prompts, attention_mask=mask, max_new_tokens=GEN_NEW)
        refused = "not refused"
    except GenerationError as e:
        refused = str(e)
    for m in parts:
        m.eval()
    out = sched.generate(prompts, max_new_tokens=GEN_NEW, return_logprobs=True)
    for m in parts:
        m.train()
    return {"sequences": out.sequences, "logprobs": out.logprobs, "padded_refused": refused}


def reference(name: str, n_layers: int, dp: int = 1) -> dict[str, Any]:
    """The unsplit model trained the same way on the global batch: losses (of data-parallel rank
    0's rows), counters after each step's forward (rank 0's rows), final parameters."""
    model = reference_model(name, n_layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    out: dict[str, Any] = {"losses": [], "counters": []}
    for tokens, labels in batches(dp):
        opt.zero_grad()
        gvt = torch.tensor(labels.numel())
        losses = [loss_fn(model(t), y, gvt)[0] for t, y in zip(tokens.chunk(dp), labels.chunk(dp))]
        sum(losses).backward()
        out["counters"].append(counters(model))
        loss = losses[0]
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        out["losses"].append(loss.detach())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, labels = (t.chunk(dp)[0] for t in batches(dp)[0])
    with torch.no_grad():  # the Validator's loss: summed, with no global_valid_tokens
        out["eval"] = loss_fn(model(tokens), labels)[0]
    return out


def _set_weights(part: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in part.named_parameters():
            value = full[_fqn(n)]
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(value)


def _fqn(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def trainer_replay(rank: int, world: int, name: str, route: str, schedule: str, fsdp: int = 1, n_layers: int = 4,
                   ac: bool = False, tp: int = 1, compile: bool = False, sp: bool = True,
                   group: Any = None, generate: bool = False) -> dict[str, Any]:
    """torchtitan's Trainer sequence on this rank; returns what this rank saw (losses on the last
    stage's rank, the rope caches init_weights computed, counters, the parts' final parameters,
    what ran in the first step: checkpointed block forwards, compiled graphs, tp-sharded weights).
    ``pp = world / (fsdp * tp)``; ``ac``: torchtitan's full AC; ``compile``: its per-block
    ``torch.compile`` with a backend counting the compiled graphs' runs; ``sp``: TP's sequence
    parallelism (activations between blocks ``Shard(1)`` over tp, else replicated); ``generate``:
    ``sched.generate`` on the trained stages after the Validator's call (:func:`generated`)."""
    tt_parallel_dims.device_type = "cpu"  # torchtitan assumes CUDA when it finds no accelerator
    tt_dist_utils.set_spmd_backend("partial_dtensor")  # as the Trainer sets it from the job config
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config(name, n_layers, sequence_parallel=sp).build()
    pp = world // (fsdp * tp)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=fsdp, cp=1, tp=tp, pp=pp, ep=1, world_size=world,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    parallelism = ParallelismConfig(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule,
                                    pipeline_parallel_microbatch_size=1, data_parallel_shard_degree=fsdp,
                                    tensor_parallel_degree=tp, enable_sequence_parallel=sp,
                                    spmd_backend="partial_dtensor")
    ac_config = FullAC.Config() if ac else None  # torchtitan's full AC: each block checkpoint-wrapped
    sched, parts, has_first, has_last = ROUTES[route](
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=CompileConfig(enable=compile, components=["model"], backend=COUNTING_BACKEND), ac_config=ac_config, dump_folder="/tmp", device=torch.device("cpu"),
        model_config=config(name, n_layers, sequence_parallel=sp), parallelize_fn=PARALLELIZE[name],
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()))
    del model
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    out: dict[str, Any] = {"has_first": has_first, "has_last": has_last, "schedule": type(sched).__name__,
                           "ropes": {_fqn(n): _full(b) for m in parts for n, b in m.named_buffers() if n.endswith("rope.cache")},
                           "finite": all(bool(torch.isfinite(_full(p)).all()) for m in parts for p in m.parameters()),
                           "tp_sharded": [_fqn(n) for m in parts for n, p in m.named_parameters()
                                          if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
                                          and any(pl.is_shard() for pl in p.placements)],
                           "dp_rank": parallel_dims.get_mesh("fsdp").get_local_rank() if fsdp > 1 else 0,
                           "tp_rank": parallel_dims.get_mesh("tp").get_local_rank() if tp > 1 else 0}
    ref = reference_model(name, n_layers)
    full = {n: p.detach() for n, p in ref.named_parameters()}
    for m in parts:
        _set_weights(m, full)
        for module in m.modules():  # gloo has no PREMUL_SUM: FSDP2's factor-1 reduce as a plain SUM, the same sum
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    pp_mesh = parallel_dims.get_mesh("pp")
    dp_rank = parallel_dims.get_mesh("fsdp").get_local_rank() if fsdp > 1 else 0
    out["losses"], out["counters"] = [], []
    n_mb = BATCH // parallelism.pipeline_parallel_microbatch_size
    ran = _RunCounts(parts)
    for all_tokens, all_labels in batches(fsdp):
        opt.zero_grad()
        gvt = torch.tensor(all_labels.numel())  # the Trainer's global_valid_tokens: summed over data-parallel ranks
        tokens, labels = all_tokens.chunk(fsdp)[dp_rank], all_labels.chunk(fsdp)[dp_rank]
        losses: list | None = [] if has_last else None
        sched.step(arg_mbs=[(t,) for t in tokens.chunk(n_mb)] if has_first else None, kwarg_mbs=[{}] * n_mb,
                   target_mbs=list(labels.chunk(n_mb)) if has_last else None, losses=losses,
                   loss_kwargs={"global_valid_tokens": gvt}, return_outputs=False)
        out["counters"].append({k: v for m in parts for k, v in counters(m).items()})
        out.setdefault("ran", ran.first_step(n_mb))
        tt_dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
        opt.step()
        if has_last:
            out["losses"].append(torch.sum(torch.stack(losses)).detach())
    out["params"] = {_fqn(n): _full(p) for m in parts for n, p in m.named_parameters()}
    tokens, labels = (t.chunk(fsdp)[dp_rank] for t in batches(fsdp)[0])
    losses = [] if has_last else None  # torchtitan's Validator: eval(arg_mbs=, kwarg_mbs=, target_mbs=, losses=)
    with torch.no_grad():
        sched.eval(arg_mbs=[(t,) for t in tokens.chunk(n_mb)] if has_first else None, kwarg_mbs=[{}] * n_mb,
                   target_mbs=list(labels.chunk(n_mb)) if has_last else None, losses=losses)
    out["eval"] = torch.sum(torch.stack(losses)) if has_last else None
    if generate:
        out["generated"] = generated(sched, parts)
    return out


COUNTING_BACKEND = "pippy_split_counting"
_COMPILED_RUNS = [0]


@torch._dynamo.register_backend(name=COUNTING_BACKEND)
def _counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A ``torch.compile`` backend that runs dynamo's graph as it is (same ops: exact) and counts its runs."""
    def run(*args: Any) -> Any:
        _COMPILED_RUNS[0] += 1
        return gm.forward(*args)
    return run


class _RunCounts:
    """What ran inside this rank's parts during the first step: the forwards of the blocks full AC
    wrapped (a forward and a recompute per microbatch when AC takes effect) and the compiled graphs."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.inner = [m for p in parts for n, m in p.named_modules() if n.endswith("_checkpoint_wrapped_module")]
        self.blocks = sum(len(list(getattr(p, "layers", None) or ())) for p in parts)
        self.calls = [0]
        self.handles = [m.register_forward_hook(lambda *_: self.calls.__setitem__(0, self.calls[0] + 1))
                        for m in self.inner]
        self.compiled_before = _COMPILED_RUNS[0]

    def first_step(self, n_mb: int) -> dict[str, int]:
        for h in self.handles:
            h.remove()
        return {"blocks": self.blocks, "microbatches": n_mb, "checkpointed_blocks": len(self.inner),
                "checkpointed_forwards": self.calls[0], "compiled_runs": _COMPILED_RUNS[0] - self.compiled_before}


def cases_body(rank: int, world: int, cases: dict[str, tuple]) -> dict[str, Any]:
    """Every case ``{key: (body, args)}`` in one spawn of the ranks; a case that raises gives
    ``{"error": its traceback}`` and the next case still runs."""
    out: dict[str, Any] = {}
    for key, (body, args) in cases.items():
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT_S))
        try:
            out[key] = body(rank, world, *args, group=group)
        except Exception:
            out[key] = {"error": f"rank {rank}, case {key}:\n{traceback.format_exc()[-4000:]}"}
    return out


def case_results(results: list[dict[str, Any]], key: str) -> list[Any]:
    errors = [r[key]["error"] for r in results if isinstance(r[key], dict) and "error" in r[key]]
    if errors:
        raise AssertionError("\n".join(errors))
    return [r[key] for r in results]


_ = tt_pipeline_llm  # torchtitan's own, for the compat route's identity checks in the tests
