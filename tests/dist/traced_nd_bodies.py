"""Rank bodies: traced stages (from ``build_schedule``) that call the user's modules, with
per-block FSDP2 or tensor parallelism applied to those modules on a DeviceMesh.

The reference is the unsplit model on the whole global batch (mean loss); a
data-parallel replica runs its half of the batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import pippy_split as ps
from pippy_split import zoo
from tests.dist.nd_bodies import _stage_grads

LAYERS = 4
STAGES = {"GPipe": 2, "1F1B": 2, "Interleaved1F1B": 4, "ZBVZeroBubble": 4, "DualPipeV": 4}


def entry(num_stages: int = 2) -> zoo.ZooEntry:
    return zoo.get("tiny_llama", n_layer=LAYERS, num_stages=num_stages, seq_len=8, batch_size=8)


def reference() -> dict:
    e = entry()
    loss = e.loss_fn(e.model(*e.args), e.target)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in e.model.named_parameters()},
            "block_numel": sum(p.numel() for p in e.model.layers[0].parameters()),
            "embedding_numel": e.model.tok_embeddings.weight.numel()}


def _n_mb(schedule: str) -> int:
    return 4 if schedule == "DualPipeV" else 2


def _gather_sizes():
    """Record the element count of every all-gather FSDP2 runs on this rank (its default
    all-gather calls ``dist.all_gather_single``)."""
    sizes: list[int] = []
    inner = dist.all_gather_single

    def spy(output, input, *a, **kw):
        sizes.append(output.numel())
        return inner(output, input, *a, **kw)

    return sizes, spy, inner


def traced_per_block_fsdp(rank: int, world: int, schedule: str) -> dict:
    """PP2 x DP2 on traced stages: ``ps.parallelize`` per block (``layers.*``) then the stage
    root, over ``mesh["dp"]``, after ``build_schedule``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    e = entry(STAGES[schedule])
    tokens, positions = e.args
    mb = 4 // _n_mb(schedule)  # each replica runs 4 rows
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:mb], positions[:mb]))
    sched = ps.build_schedule(pipe, schedule, _n_mb(schedule), loss_fn=e.loss_fn, group=mesh["pp"])
    called = [str(n.target) for st in sched.stages for n in st.module.graph.nodes if n.op == "call_module"]
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"])
    sizes, spy, inner = _gather_sizes()
    dist.all_gather_single = spy
    try:
        half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
        sched.step(tokens[half], positions[half], target=e.target[half])
    finally:
        dist.all_gather_single = inner
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages), "gathers": sizes, "called": called}


def traced_tp(rank: int, world: int, schedule: str) -> dict:
    """PP2 x TP2 on traced stages: ``ps.parallelize`` with a Megatron-style plan of the
    layers each stage calls; both TP ranks run the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    e = entry(STAGES[schedule])
    tokens, positions = e.args
    mb = 8 // _n_mb(schedule)  # both TP ranks run all 8 rows
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:mb], positions[:mb]))
    sched = ps.build_schedule(pipe, schedule, _n_mb(schedule), loss_fn=e.loss_fn, group=mesh["pp"])
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"layers.*.{lin}": ColwiseParallel() for lin in ("attention.wq", "attention.wk", "attention.wv",
                                                            "feed_forward.w1", "feed_forward.w3")}
    plan.update({f"layers.*.{lin}": RowwiseParallel() for lin in ("attention.wo", "feed_forward.w2")})
    ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan=plan)
    sched.step(tokens, positions, target=e.target)
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages),
            "fused": [st.weight_grads_in_input for st in sched.stages]}


def traced_glue_refused(rank: int, world: int) -> str:
    """A pattern naming a module a split point enters: refused by name."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    e = entry()
    tokens, positions = e.args
    pipe = ps.pipeline(e.model, {"layers.1.feed_forward": ps.SplitPoint.BEGINNING}, (tokens[:2], positions[:2]))
    try:
        ps.parallelize(pipe.build_stage(0), dp_mesh=mesh["dp"], fsdp=["layers.*"])
    except ps.PipelineError as err:
        return str(err)
    return "no error"


# ---- an HF Llama (its own loss through labels=) -------------------------------------------

def hf_llama():
    """A tiny HF Llama (4 layers, no KV cache) and a batch of 8 sequences of 8 tokens."""
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = t.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


def hf_reference() -> dict:
    model, ids = hf_llama()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def hf_traced(rank: int, world: int, schedule: str, kind: str) -> dict:
    """PP2 x (FSDP2 per decoder layer | TP2) on traced stages of an HF Llama."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims = ("dp", "pp") if kind == "fsdp" else ("pp", "tp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    model, ids = hf_llama()
    rows = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4) if kind == "fsdp" else slice(0, 8)
    batch = ids[rows]
    n_mb = 2
    mb = batch[: batch.shape[0] // n_mb]
    split = ["model.layers.2"] if STAGES[schedule] == 2 else ["model.layers.1", "model.layers.2", "model.layers.3"]
    pipe = ps.pipeline(model, split, (mb,), {"labels": mb})
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=lambda out, _: out.loss, group=mesh["pp"])
    if kind == "fsdp":
        ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["model.layers.*"])
    else:
        plan = {f"model.layers.*.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan.update({f"model.layers.*.mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
        plan.update({"model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()})
        ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan=plan)
    sched.step(batch, labels=batch, target=batch)
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages)}
