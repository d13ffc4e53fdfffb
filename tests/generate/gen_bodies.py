"""Rank bodies of the generation tests (top-level so they pickle) and their references."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split.zoo import layer_split

from .models import VOCAB, prompts

N_MB = 4
LR = 0.5


def llama8() -> torch.nn.Module:
    """A tiny HF Llama with 8 blocks (8 stages on 4 ranks under V and interleaved placement)."""
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return t.LlamaForCausalLM(cfg).eval()


def gpt8() -> torch.nn.Module:
    from pippy_split import zoo

    return zoo.get("tiny_gpt", n_layer=8).model


MODELS = {"llama": (llama8, "model.layers"), "tiny_gpt": (gpt8, "blocks")}


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def train_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 64, (4, 8), generator=g)
    return ids, torch.roll(ids, -1, 1)


def build(name: str, schedule: str, stages: int) -> tuple[torch.nn.Module, Any, Any]:
    make, blocks = MODELS[name]
    model = make()
    ids, _ = train_batch()
    pipe = ps.pipeline(model, layer_split(blocks, 8, stages), (ids[: 4 // N_MB],))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=lm_loss)
    return model, pipe, sched


def generate_body(rank: int, world: int, name: str, schedule: str, stages: int, kwargs: dict,
                  train_first: bool = False) -> dict:
    """Build the schedule, optionally train one SGD step, then generate on every rank."""
    _, _, sched = build(name, schedule, stages)
    if train_first:
        _train_step(sched)
    ids, mask = prompts(True, batch=5)
    ids = ids % 64
    out = sched.generate(ids, attention_mask=mask, return_logprobs=True, **kwargs)
    return {"sequences": out.sequences, "logprobs": out.logprobs}


def _train_step(sched: Any) -> None:
    params = [p for st in sched.stages for p in st.module.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    ids, target = train_batch()
    sched.step(ids, target=target)
    opt.step()
    opt.zero_grad()


def reference(name: str, kwargs: dict, train_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model: optionally the same SGD step on the whole batch, then pipe.generate
    on a one-stage pipe (itself checked against HF generate / no-cache decoding elsewhere)."""
    make, _ = MODELS[name]
    model = make()
    if train_first:
        ids, target = train_batch()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loss = sum(lm_loss(model(i), t) for i, t in
                   zip(ids.chunk(N_MB), target.chunk(N_MB))) / N_MB
        loss.backward()
        opt.step()
    ids, mask = prompts(True, batch=5)
    ids = ids % 64
    if name == "llama":
        out = model.generate(ids, attention_mask=mask, max_new_tokens=kwargs["max_new_tokens"], do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             **{k: v for k, v in kwargs.items() if k in ("eos_token_id", "pad_token_id")})
        seq = out.sequences
        lp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1)
        lp = lp.gather(2, seq[:, ids.shape[1]:, None])[..., 0]
        return seq, lp
    pipe = ps.pipeline(model, None, (ids,))
    out = pipe.generate(ids, attention_mask=mask, return_logprobs=True, **kwargs)
    return out.sequences, out.logprobs


def bad_call_body(rank: int, world: int, kwargs: dict) -> str:
    """A bad generate() call on every rank: each returns the error it raised (none hangs)."""
    from pippy_split.generate import GenerationError

    _, _, sched = build("tiny_gpt", "1F1B", world)
    ids, mask = prompts(True, batch=3)
    try:
        sched.generate(ids % 64, attention_mask=mask, **kwargs)
    except GenerationError as e:
        return str(e)
    return "no error"


def failing_rank_body(rank: int, world: int) -> dict:
    """Rank 1 fails in the middle of generation; every rank reports what it raised and when."""
    import time

    from pippy_split.generate.stage_step import StageDecoder

    _, _, sched = build("tiny_gpt", "1F1B", world)
    if rank == 1:
        original = StageDecoder.run
        calls = [0]

        def run(self: StageDecoder, *args: Any) -> Any:
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("injected failure")
            return original(self, *args)

        StageDecoder.run = run  # type: ignore[method-assign]
    ids, mask = prompts(True, batch=4)
    start = time.perf_counter()
    try:
        sched.generate(ids % 64, attention_mask=mask, max_new_tokens=8)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def generate_on_fsdp_stages(rank: int, world: int):
    """A schedule whose stage is under fully_shard (whole stage): generate() gathers it for
    the call and gives what the unsharded pipe gave (it used to refuse such stages)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import pippy_split as ps
    from pippy_split import zoo

    entry = zoo.get("tiny_gpt")
    pipe = ps.pipeline(entry.model, 1, (entry.args[0][:2],))
    sched = ps.build_schedule(pipe, "1F1B", 2, loss_fn=entry.loss_fn)
    prompt = torch.arange(6).reshape(2, 3) % 64
    before = pipe.generate(prompt, max_new_tokens=3, return_logprobs=True)
    fully_shard(sched.stages[0].module, mesh=init_device_mesh("cpu", (world,)))
    out = sched.generate(prompt, max_new_tokens=3, return_logprobs=True)
    return before.sequences, before.logprobs, out.sequences, out.logprobs


def generate_on_meta_body(rank: int, world: int, kwargs: dict) -> torch.Tensor:
    """A pipe traced on a ``meta`` HF Llama, each rank's stages filled from the state dict
    (as a big model is built): generate reads shapes of the other ranks' layers only."""
    model = llama8()
    with torch.device("meta"):
        meta = type(model)(model.config).eval()
    ids, _ = train_batch()
    pipe = ps.pipeline(meta, layer_split("model.layers", 8, world), (ids[: 4 // N_MB],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=lm_loss, state_dict=model.state_dict())
    prompt, mask = prompts(True, batch=5)
    return sched.generate(prompt % 64, attention_mask=mask, **kwargs).sequences
