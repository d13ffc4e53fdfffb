"""Rank bodies and references for microbatches of different shapes in one step (top-level so they pickle).

Every case is a zoo model traced with one dynamic dim and a step whose four
microbatches differ in it, given as ``ps.Microbatches``; the reference is the unsplit
model on the same microbatches (mean over microbatches, or sum over items with
``loss_count``).
"""

from __future__ import annotations

import torch
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo

LENGTHS = [16, 32, 24, 8]
LENGTHS_8 = [16, 32, 24, 8, 12, 28, 20, 4]  # 4 ranks: DualPipeV needs 2 * ranks - 1 microbatches
ALL_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV"]
ONE_STAGE_PER_RANK = {"GPipe", "1F1B"}


def case(name: str, num_stages: int, sizes: list[int] = LENGTHS):
    """(model, microbatch args, targets, loss_fn, split spec, example args, dynamic_shapes) for one zoo model."""
    if name == "fan_out_skip":  # an MLP: the varying dim is each microbatch's batch size
        entry = zoo.get(name, batch_size=sum(sizes))
        split = {2: ["tail"], 4: ["mid", "mid.1", "tail"]}[num_stages]
        x, y = entry.args[0], entry.target
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        mbs = [(x[s:s + n],) for s, n in zip(starts, sizes)]
        tgts = [y[s:s + n] for s, n in zip(starts, sizes)]
        return entry.model, mbs, tgts, entry.loss_fn, split, (x[:4],), {"x": {0: Dim("B", min=1, max=64)}}
    n_layer = max(4, num_stages)
    entry = zoo.get(name, n_layer=n_layer, batch_size=2 * len(sizes))
    prefix = "blocks" if name == "tiny_gpt" else "layers"
    split = zoo.layer_split(prefix, n_layer, num_stages)
    args, y = entry.args, entry.target
    mbs = [tuple(a[2 * k:2 * k + 2, :n] for a in args) for k, n in enumerate(sizes)]
    tgts = [y[2 * k:2 * k + 2, :n] for k, n in enumerate(sizes)]
    T = Dim("T", min=2, max=32)
    names = ["idx"] if name == "tiny_gpt" else ["tokens", "positions"]
    dyn = {n: {1: T} for n in names}
    return entry.model, mbs, tgts, entry.loss_fn, split, tuple(a[:2] for a in args), dyn


def stages_for(schedule: str, world: int) -> int:
    return world if schedule in ONE_STAGE_PER_RANK else 2 * world


def reference(name: str, num_stages: int, *, loss_count: bool = False, autocast: bool = False,
              sizes: list[int] = LENGTHS):
    """Loss and every gradient of the unsplit model over the same microbatches (under autocast:
    the loss in fp32 of the low-precision output, as a stage computes it)."""
    model, mbs, tgts, loss_fn, *_ = case(name, num_stages, sizes)
    total, items = 0.0, sum(float((t != -100).sum()) for t in tgts) if loss_count else None
    for a, t in zip(mbs, tgts):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(*a)
        out = out.float()
        loss = _sum_loss(out, t) / items if loss_count else loss_fn(out, t) / len(mbs)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def _sum_loss(out, t):
    return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), t.flatten(), reduction="sum")


def _grads(sched) -> dict:
    return {n: p.grad.clone() for st in sched.stages for n, p in st.module.named_parameters(remove_duplicate=False)
            if p.grad is not None}


def every_schedule(rank: int, world: int, name: str, schedules: list[str], sizes: list[int] = LENGTHS):
    """One step with unequal microbatches under each schedule: {schedule: loss, grads, output shapes}."""
    results = {}
    for schedule in schedules:
        n = stages_for(schedule, world)
        model, mbs, tgts, loss_fn, split, example, dyn = case(name, n, sizes)
        pipe = ps.pipeline(model, split, example, dynamic_shapes=dyn)
        sched = ps.build_schedule(pipe, schedule, len(mbs), loss_fn=loss_fn)
        xs = [ps.Microbatches(a[i] for a in mbs) for i in range(len(mbs[0]))]
        out = sched.step(*xs, target=ps.Microbatches(tgts))
        results[schedule] = {"loss": float(sched.loss), "grads": _grads(sched),
                             "out": None if out is None else [tuple(o.shape) for o in out],
                             "out_type": type(out).__name__}
    return results


def with_options(rank: int, world: int, schedule: str, option: str):
    """tiny_llama, unequal microbatches, one stage option: full / selective AC, bf16, loss_count + clip."""
    n = stages_for(schedule, world)
    model, mbs, tgts, loss_fn, split, example, dyn = case("tiny_llama", n)
    pipe = ps.pipeline(model, split, example, dynamic_shapes=dyn)
    kwargs: dict = {}
    if option == "full_ac":
        kwargs["activation_checkpoint"] = "full"
    elif option == "selective_ac":
        kwargs["activation_checkpoint"] = ["layers.*"]
    elif option == "bf16":
        kwargs["mixed_precision"] = torch.bfloat16
    elif option == "loss_count":
        kwargs.update(loss_fn=_sum_loss, loss_count=lambda t: (t != -100).sum())
    kwargs.setdefault("loss_fn", loss_fn)
    sched = ps.build_schedule(pipe, schedule, len(mbs), **kwargs)
    xs = [ps.Microbatches(a[i] for a in mbs) for i in range(len(mbs[0]))]
    sched.step(*xs, target=ps.Microbatches(tgts))
    norm = float(ps.clip_grad_norm_(sched, 1e9)) if option == "loss_count" else None
    return {"loss": float(sched.loss), "grads": _grads(sched), "norm": norm}


def bad_step(rank: int, world: int, what: str):
    """A step that must fail on every rank before any message; returns each rank's error text."""
    model, mbs, tgts, loss_fn, split, example, dyn = case("tiny_gpt", 2)
    pipe = ps.pipeline(model, split, example, dynamic_shapes=dyn)
    sched = ps.build_schedule(pipe, "1F1B", len(mbs), loss_fn=loss_fn)
    xs = [a[0] for a in mbs]
    if what == "out_of_range":
        xs[2] = torch.zeros(2, 40, dtype=torch.long)
    elif what == "static_dim":
        xs[1] = torch.zeros(3, 16, dtype=torch.long)  # the batch dim was traced static (2)
    elif what == "wrong_count":
        xs = xs[:3]
    try:
        sched.step(ps.Microbatches(xs), target=ps.Microbatches(tgts))
    except Exception as e:  # noqa: BLE001 - the test checks the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def ranks_disagree(rank: int, world: int):
    """The late model input (positions) reaches rank 1 with other lengths than rank 0's."""
    model, mbs, tgts, loss_fn, split, example, dyn = case("tiny_llama", 2)
    pipe = ps.pipeline(model, split, example, dynamic_shapes=dyn)
    sched = ps.build_schedule(pipe, "1F1B", len(mbs), loss_fn=loss_fn)
    toks, pos = [a[0] for a in mbs], [a[1] for a in mbs]
    if rank == 1:
        toks[3] = toks[3][:, :6]
        pos[3] = pos[3][:, :6]
    try:
        sched.step(ps.Microbatches(toks), ps.Microbatches(pos), target=ps.Microbatches(tgts))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---- packed documents: positions restart at every document, attention stays inside it ----

def packed_docs(n_mb: int = 4, budget: int = 24):
    """Documents of random lengths packed into ``n_mb`` microbatches of different lengths."""
    from pippy_split.packing import pack_documents

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 11, (60,), generator=g).tolist()
    docs = [torch.randint(1, 64, (n,), generator=g).tolist() for n in lengths]
    mbs = list(pack_documents(docs, budget))[:n_mb]
    assert len({mb.shape[1] for mb in mbs}) > 1  # the point: unequal microbatches
    return mbs


def packed_loss(out, t):
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), t.flatten(), ignore_index=-100,
                                             reduction="sum")


def packed_model(kind: str):
    """(model, kwargs of one microbatch, dynamic_shapes, split by stage count) for a packed batch."""
    if kind == "qwen2":
        import transformers as t
        torch.manual_seed(0)
        cfg = t.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        cfg._attn_implementation = "sdpa"
        model = t.Qwen2ForCausalLM(cfg)

        def inputs(mb):
            return {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "attention_mask": mb.attention_mask()}
        T = Dim("T", min=2, max=64)
        dyn = {"input_ids": {1: T}, "position_ids": {1: T}, "attention_mask": {2: T, 3: T}}
        return model, inputs, dyn, lambda n: zoo.layer_split("model.layers", 4, n)
    entry = zoo.get("tiny_llama", n_layer=4)

    def inputs(mb):
        return {"tokens": mb.input_ids, "positions": mb.position_ids, "documents": mb.document_ids}
    T = Dim("T", min=2, max=64)
    dyn = {"tokens": {1: T}, "positions": {1: T}, "documents": {1: T}}
    return entry.model, inputs, dyn, lambda n: zoo.layer_split("layers", 4, n)


def packed_reference(kind: str, num_stages: int):
    """The unsplit model on the same packed microbatches: the token mean of the step."""
    model, inputs, _, _ = packed_model(kind)
    mbs = packed_docs()
    items = sum(float((mb.targets != -100).sum()) for mb in mbs)
    total = 0.0
    for mb in mbs:
        loss = packed_loss(model(**inputs(mb)), mb.targets) / items
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_step(rank: int, world: int, kind: str, schedule: str):
    model, inputs, dyn, split = packed_model(kind)
    mbs = packed_docs()
    pipe = ps.pipeline(model, split(stages_for(schedule, world)), (), inputs(mbs[0]), dynamic_shapes=dyn)
    sched = ps.build_schedule(pipe, schedule, len(mbs), loss_fn=packed_loss,
                              loss_count=lambda t: (t != -100).sum())
    per_field = {k: ps.Microbatches(inputs(mb)[k] for mb in mbs) for k in inputs(mbs[0])}
    sched.step(target=ps.Microbatches(mb.targets for mb in mbs), **per_field)
    return {"loss": float(sched.loss), "grads": _grads(sched), "lengths": [mb.shape[1] for mb in mbs]}


def hand_built_unequal(rank: int, world: int):
    """Hand-built stages (no Pipe) given microbatches of different batch sizes: refused on every rank."""
    torch.manual_seed(0)
    part = torch.nn.Linear(6, 6) if rank == 0 else torch.nn.Linear(6, 3)
    stage = ps.PipelineStage(part, rank, world, "cpu")
    sched = ps.get_schedule_class("1F1B")(stage, 4, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    sizes = [2, 2, 3, 1]
    starts = [0, 2, 4, 7]
    try:
        sched.step(ps.Microbatches(x[s:s + n] for s, n in zip(starts, sizes)),
                   target=ps.Microbatches(y[s:s + n] for s, n in zip(starts, sizes)))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"
