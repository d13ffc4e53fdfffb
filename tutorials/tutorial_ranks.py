"""Rank bodies for tutorials 04 and 07, in a module of their own.

A rank process started by ``run_ranks`` (or multiprocessing generally) finds its
function by importing the module that defines it. A function defined in a notebook
cell lives in ``__main__``, which a fresh process cannot import, so the notebook
imports ``train`` (04) and ``nd_step`` / ``nd_tour`` (07) from here (this file sits beside the tutorials, on the notebook's
path) and the ranks import it the same way.
"""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo

__all__ = ["nd_step", "nd_tour", "train"]


def train(rank: int, world_size: int, steps: int = 4, schedule: str = "ZBVZeroBubble") -> list[float]:
    """Train the zoo's tiny GPT for ``steps`` steps on this rank's stages; return the losses."""
    entry = zoo.get("tiny_gpt")  # 4 blocks -> 4 stages; with 2 ranks, 2 stages per rank
    (x,), y = entry.args, entry.target  # (8, 32) token ids and next-token targets
    n_mb = 4
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[: x.shape[0] // n_mb],))
    sched = ps.build_schedule(pipe, schedule, n_microbatches=n_mb, loss_fn=entry.loss_fn)
    params = [p for stage in sched.stages for p in stage.module.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    if rank == 0:
        print(f"{schedule}: rank {rank} holds stages {[s.stage_index for s in sched.stages]}", flush=True)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        sched.step(x, target=y)  # identical call on every rank
        opt.step()
        losses.append(float(sched.loss))  # the step's mean loss, known on every rank
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    return losses


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV", "Interleaved1F1B", "InterleavedZeroBubble")  # 2 stages per rank


def nd_step(shape: tuple[int, int, int], schedule: str = "1F1B", by_hand: bool = False) -> dict:
    """One training step of the tiny Llama on a ``(pp, dp, tp)`` DeviceMesh of this job's ranks.

    Pipeline stages over ``mesh["pp"]``, each block ``fully_shard``-ed over ``mesh["dp"]``,
    Megatron-style tensor parallelism over ``mesh["tp"]``. Asserts on every rank that the
    loss and every gradient equal the unsplit model's on the same global batch.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    pp, dp, tp = shape
    n_stages = 2 * pp if schedule in V_SCHEDULES else pp

    def llama() -> zoo.ZooEntry:  # seeded: every call, on every rank, has the same weights and batch
        return zoo.get("tiny_llama", n_layer=4, num_stages=n_stages, seq_len=8, batch_size=8)

    # The reference: the unsplit model, one process, the whole global batch of 8 rows.
    ref = llama()
    ref_loss = ref.loss_fn(ref.model(*ref.args), ref.target)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.model.named_parameters()}

    # This replica's share: data-parallel replicas split the batch; TP ranks share theirs.
    e = llama()
    tokens, positions = e.args
    rows = tokens.shape[0] // dp
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    n_mb = 2
    mb = rows // n_mb
    tp_plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
               "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
               "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
               "feed_forward.w2": RowwiseParallel()}
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:mb], positions[:mb]))
    if by_hand and tp > 1:
        # By hand, TP can go on your blocks before the schedule is built (the stages call these
        # very objects), so a zero-bubble schedule plans its I/W split on the TP weights.
        for block in e.model.layers:
            parallelize_module(block, mesh["tp"], tp_plan)
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=e.loss_fn, group=mesh["pp"])

    # A traced stage's graph calls your own module objects (call_module nodes, original FQNs),
    # so fully_shard / parallelize_module applied to them take effect in the pipeline.
    called = {st.stage_index: [str(n.target) for n in st.module.graph.nodes if n.op == "call_module"]
              for st in sched.stages}
    for st in sched.stages:
        for name in called[st.stage_index]:
            assert st.module.get_submodule(name) is e.model.get_submodule(name)

    # A mesh dimension of size 1 has nothing to divide: its parallelism is skipped (FSDP2 over
    # one rank would only cost a zero-bubble schedule its I/W split).
    if not by_hand:  # patterns relative to the stage module; one call per rank, all its stages
        kw: dict = {}
        if tp > 1:
            kw.update(tp_mesh=mesh["tp"], tp_plan={f"layers.*.{k}": v for k, v in tp_plan.items()})
        if dp > 1:
            kw.update(dp_mesh=mesh["dp"], fsdp=["layers.*"])
        ps.parallelize(sched, **kw)
    elif dp > 1:  # the same FSDP2 in plain torch: each block this rank's stages call, then the root
        for st in sched.stages:
            for name in called[st.stage_index]:
                if name.startswith("layers."):
                    fully_shard(st.module.get_submodule(name), mesh=mesh["dp"])  # model.layers[i] itself
            fully_shard(st.module, mesh=mesh["dp"])  # the rest: embedding, final norm, head

    sched.step(tokens[mine], positions[mine], target=e.target[mine])

    # Exactness. The loss: the mean over the data-parallel replicas (equal halves of the batch).
    loss = torch.tensor(float(sched.loss))
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    loss = float(loss) / dp
    assert abs(loss - ref_loss.item()) < 1e-5, f"loss {loss} vs unsplit {ref_loss.item()}"
    # Every gradient: FSDP2 already averaged it over the replicas; full_tensor() gathers the
    # shards (dp and tp) into the whole tensor, on every rank.
    worst, checked = 0.0, []
    for st in sched.stages:
        for name, p in st.module.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
            worst = max(worst, float((g - ref_grads[name]).abs().max()))
            checked.append(name)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, checked)
    assert set().union(*everyone) == set(ref_grads), "some parameter got no gradient"

    if dist.get_rank() == 0:
        how = "by hand" if by_hand else "ps.parallelize"
        print(f"(pp={pp}, dp={dp}, tp={tp}) {schedule:<13} {how:<14} rank 0: stages {sorted(called)} call "
              f"{[n for i in sorted(called) for n in called[i]]}\n    loss {loss:.6f} = unsplit "
              f"{ref_loss.item():.6f}; {len(ref_grads)} gradients, max |diff| {worst:.1e}", flush=True)
    return {"loss": loss, "ref_loss": ref_loss.item(), "max_diff": worst, "called": called}


def nd_tour(rank: int, world_size: int, runs: list[tuple]) -> list[dict]:
    """Run :func:`nd_step` for each ``(shape, schedule, by_hand)`` in ``runs``, in order.

    Rank 0 prints each run's line and, once per run, what the library warned about.
    """
    import logging
    import warnings

    # DTensor logs a hint on every rank each time full_tensor() gathers a gradient sharded
    # over two mesh dimensions with two collectives; at this size that is what we want.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = []
    for shape, schedule, by_hand in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(nd_step(tuple(shape), schedule, by_hand))
        notes = sorted({str(w.message).split(": ", 1)[1] for w in caught if ": " in str(w.message)})
        results[-1]["warnings"] = notes
        if rank == 0:
            for note in notes:
                print(f"    warned (once per stage): {note[:150]}...", flush=True)
    return results
