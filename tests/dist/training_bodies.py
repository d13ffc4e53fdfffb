"""Rank bodies for the training-kit dist tests: token-normalised losses, gradient clipping."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split import zoo

N_MB = 4


def padded_batch():
    """tiny GPT batch whose microbatches hold very different numbers of valid tokens."""
    entry = zoo.get("tiny_gpt")
    x, target = entry.args[0], entry.target.clone()
    valid = [32, 3, 17, 0, 25, 32, 1, 9]  # per sample; microbatch 1 (samples 2, 3) has 17 tokens
    for i, n in enumerate(valid):
        target[i, n:] = -100
    return entry, x, target


def sum_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")


def valid_tokens(target):
    return (target != -100).sum()


def token_reference():
    entry, x, target = padded_batch()
    loss = F.cross_entropy(entry.model(x).flatten(0, 1), target.flatten(), ignore_index=-100)  # mean over valid
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in entry.model.named_parameters()}


def token_step(rank: int, world: int, schedule: str, steps: int = 1):
    entry, x, target = padded_batch()
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=sum_loss, loss_count=valid_tokens)
    for _ in range(steps):
        sched.step(x, target=target)
    grads = {n: p.grad.clone() for st in sched.stages for n, p in st.module.named_parameters() if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads}


def zero_items_step(rank: int, world: int):
    entry, x, target = padded_batch()
    target[:] = -100
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=sum_loss, loss_count=valid_tokens)
    try:
        sched.step(x, target=target)
    except ps.PipelineError as e:
        return str(e)
    return None


def clip_reference(name: str, n_mb: int, max_norm_frac: float, norm_type: float):
    """The unsplit model's total norm and clipped gradients (max_norm = frac x the norm)."""
    from .bodies import reference

    model = zoo.get(name).model  # zoo.get builds the same seeded model every time
    _, grads = reference(name, n_mb)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied: both names, one tensor
    for n, g in grads.items():
        params[n].grad = g.clone()
    unique = list(model.parameters())  # tied weights once, as torch counts them
    norm = torch.nn.utils.get_total_norm([p.grad for p in unique], norm_type)
    max_norm = max_norm_frac * float(norm)
    total = torch.nn.utils.clip_grad_norm_(unique, max_norm, norm_type)
    return float(total), max_norm, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


def clip_step(rank: int, world: int, name: str, schedule: str, n_mb: int, max_norm: float, norm_type: float):
    """One step, then ps.clip_grad_norm_: the total and the clipped gradients by FQN
    (``name`` a zoo model, or "tied_groups" for :func:`tied_groups_entry`)."""
    from .bodies import _mb_example

    entry = tied_groups_entry() if name == "tied_groups" else zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    total = ps.clip_grad_norm_(sched, max_norm, norm_type)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"total": float(total), "grads": grads, "stages": [st.stage_index for st in sched.stages]}


def ac_step(rank: int, world: int, name: str, schedule: str, n_mb: int):
    """One step with activation_checkpoint="full"; also counts each stage module's calls."""
    from .bodies import _mb_example

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, activation_checkpoint="full")
    calls = {}
    for st in sched.stages:
        calls[st.stage_index] = 0

        def count(module, args, out, s=st.stage_index):
            calls[s] += 1

        st.module.register_forward_hook(count)
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "calls": calls}


def moe_case():
    """A tiny HF Mixtral whose router logits from every layer feed the auxiliary loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=0.1, max_position_embeddings=64)
    return MixtralForCausalLM(cfg), torch.randint(0, 64, (8, 16))


def model_loss(out, _target):
    return out.loss  # the model's own: cross entropy + router_aux_loss_coef * load-balancing loss


def moe_reference(n_mb: int):
    model, x = moe_case()
    total = 0.0
    for xm in x.chunk(n_mb):
        out = model(input_ids=xm, labels=xm)
        assert out.aux_loss is not None and out.aux_loss.item() > 0
        (out.loss / n_mb).backward()
        total += out.loss.item() / n_mb
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def moe_step(rank: int, world: int, schedule: str, n_mb: int):
    model, x = moe_case()
    mb = x.chunk(n_mb)[0]
    split = {2: ["model.layers.2"], 4: ["model.layers.1", "model.layers.2", "model.layers.3"]}[world]
    pipe = ps.pipeline(model, split, (), {"input_ids": mb, "labels": mb})
    router_edges = [e for e in pipe.edges if e.dst_stage == pipe.num_stages - 1 and e.spec.carries_grad
                    and e.sender_stage < pipe.num_stages - 2]
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=model_loss)
    sched.step(input_ids=x, labels=x, target=x)
    grads = {n: p.grad.clone() for st in sched.stages for n, p in st.module.named_parameters() if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "skips": len(router_edges)}


def bf16_reference(name: str, n_mb: int):
    """The unsplit model under the same autocast (bf16), its loss in fp32."""
    entry = zoo.get(name)
    mbs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)
    tgts = ps.split_args_kwargs((entry.target,), {}, n_mb)
    total = 0.0
    for (a, k), (t, _) in zip(mbs, tgts):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = entry.model(*a, **k)
        out = out.float() if isinstance(out, torch.Tensor) else out
        loss = entry.loss_fn(out, t[0]) / n_mb
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in entry.model.named_parameters(remove_duplicate=False)
                   if p.grad is not None}


def bf16_step(rank: int, world: int, name: str, schedule: str, n_mb: int):
    from .bodies import _mb_example

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, mixed_precision=torch.bfloat16)
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    dtypes = sorted({str(r.spec.dtype) for st in sched.stages for r in st.routes if r.spec is not None})
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "edge_dtypes": dtypes}


def fp16_reference(name: str, n_mb: int, scale: float):
    """The unsplit model under fp16 autocast, loss (fp32) x scale, gradients unscaled."""
    entry = zoo.get(name)
    mbs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)
    tgts = ps.split_args_kwargs((entry.target,), {}, n_mb)
    for (a, k), (t, _) in zip(mbs, tgts):
        with torch.autocast("cpu", dtype=torch.float16):
            out = entry.model(*a, **k)
        (entry.loss_fn(out.float(), t[0]) * scale / n_mb).backward()
    return {n: p.grad / scale for n, p in entry.model.named_parameters(remove_duplicate=False) if p.grad is not None}


def fp16_step(rank: int, world: int, name: str, schedule: str, n_mb: int, scale: float, poison_rank: int):
    """One fp16 step with a PipelineGradScaler; ``poison_rank`` (or -1) fakes an overflow there only."""
    from .bodies import _mb_example

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, mixed_precision=torch.float16)
    scaler = ps.PipelineGradScaler(sched, init_scale=scale)
    params = [p for st in sched.stages for p in st.module.parameters()]
    opt = torch.optim.SGD(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    if rank == poison_rank:
        params[0].grad.view(-1)[0] = float("inf")
    grads = {n: p.grad.clone() / scale for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    stepped = scaler.step(opt)
    changed = any(not torch.equal(b, p) for b, p in zip(before, params))
    return {"grads": grads, "stepped": stepped, "changed": changed, "scale": scaler.scale}


def zoo_step(name: str, schedule: str, n_mb: int, **options):
    """One step of a zoo model built with ``build_schedule(..., **options)``: the schedule,
    and its loss and this rank's grads by FQN."""
    from .bodies import _mb_example

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, **options)
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return sched, {"loss": float(sched.loss), "grads": grads}


def compile_step(rank: int, world: int, name: str, schedule: str, n_mb: int):
    torch.set_num_threads(1)
    return zoo_step(name, schedule, n_mb, compile=True)[1]


def tied_groups_entry():
    """tied_lm over 4 stages (one block each) with three tied groups: the embedding and the
    head (stages 0 and 3), blocks.0/blocks.3's MLP input weight (stages 0 and 3), and
    blocks.1/blocks.2's attention output weight (stages 1 and 2). Under V placement on 2
    ranks every group's holders sit on one rank; under loop placement on different ranks."""
    entry = zoo.get("tied_lm", num_stages=4)
    blocks = entry.model.blocks
    blocks[3].mlp.fc.weight = blocks[0].mlp.fc.weight
    blocks[2].attn.proj.weight = blocks[1].attn.proj.weight
    return entry


def _tied_reference_grads(entry, n_mb: int):
    model = entry.model
    mbs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)
    tgts = ps.split_args_kwargs((entry.target,), {}, n_mb)
    for (a, k), (t, _) in zip(mbs, tgts):
        (entry.loss_fn(model(*a, **k), t[0]) / n_mb).backward()


def tied_groups_clip_reference(n_mb: int, max_norm_frac: float, norm_type: float):
    """Total norm and clipped gradients of the unsplit three-tied-groups model."""
    entry = tied_groups_entry()
    _tied_reference_grads(entry, n_mb)
    unique = list(entry.model.parameters())  # each tied tensor once
    max_norm = max_norm_frac * float(torch.nn.utils.get_total_norm([p.grad for p in unique], norm_type))
    total = torch.nn.utils.clip_grad_norm_(unique, max_norm, norm_type)
    return float(total), max_norm, {n: p.grad.clone() for n, p in entry.model.named_parameters(remove_duplicate=False)}
