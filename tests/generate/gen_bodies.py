"""Rank bodies of the generation tests (top-level so they pickle) and their references.

The test models have ``layers_for(stages)`` blocks: 4, or one per stage where a pipe has more
stages (each rank traces the decode step of the whole model, block by block, so a block no
stage needs only costs time). :func:`cases_body` runs several cases on one set of ranks.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pippy_split as ps
from pippy_split.zoo import layer_split

from .models import VOCAB, prompts

N_MB = 4
LR = 0.5
CASE_TIMEOUT_S = 240.0  # one case's blocking waits in cases_body


def layers_for(stages: int) -> int:
    """Blocks of the test models cut into ``stages`` stages: 4 (two stages hold two blocks each),
    or one per stage beyond that."""
    return max(4, stages)


def llama(layers: int) -> torch.nn.Module:
    """A tiny HF Llama with ``layers`` blocks."""
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return t.LlamaForCausalLM(cfg).eval()


def gpt(layers: int) -> torch.nn.Module:
    from pippy_split import zoo

    return zoo.get("tiny_gpt", n_layer=layers).model


MODELS: dict[str, tuple[Callable[[int], torch.nn.Module], str]] = {"llama": (llama, "model.layers"),
                                                                   "tiny_gpt": (gpt, "blocks")}


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def train_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 64, (4, 8), generator=g)
    return ids, torch.roll(ids, -1, 1)


def build(name: str, schedule: str, stages: int, group: Any = None) -> tuple[torch.nn.Module, Any, Any]:
    make, blocks = MODELS[name]
    model = make(layers_for(stages))
    ids, _ = train_batch()
    pipe = ps.pipeline(model, layer_split(blocks, layers_for(stages), stages), (ids[: 4 // N_MB],))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=lm_loss, group=group)
    return model, pipe, sched


def cases_body(rank: int, world: int, cases: dict[str, tuple[Callable[..., Any], tuple]]) -> dict[str, Any]:
    """Every case ``{key: (body, args)}`` on these ranks, in order: ``body(rank, world, *args,
    group=...)`` in a fresh process group of its own; one that raises gives ``{"error": its
    traceback}`` and the next case still runs (several tests share one spawn of the ranks)."""
    out: dict[str, Any] = {}
    for key, (body, args) in cases.items():
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT_S))
        try:
            out[key] = body(rank, world, *args, group=group)
        except Exception:
            out[key] = {"error": f"rank {rank}, case {key}:\n{traceback.format_exc()[-4000:]}"}
    return out


def case_results(results: list[dict[str, Any]], key: str) -> list[Any]:
    """Case ``key`` of a :func:`cases_body` run, one result per rank; a case that raised fails
    the test with every rank's traceback."""
    errors = [r[key]["error"] for r in results if isinstance(r[key], dict) and "error" in r[key]]
    if errors:
        raise AssertionError("\n".join(errors))
    return [r[key] for r in results]


def generate_body(rank: int, world: int, name: str, schedule: str, stages: int, kwargs: dict,
                  train_first: bool = False, group: Any = None) -> dict:
    """Build the schedule, optionally train one SGD step, then generate on every rank."""
    _, _, sched = build(name, schedule, stages, group)
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


def reference(name: str, kwargs: dict, layers: int, train_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model with ``layers`` blocks: optionally the same SGD step on the whole batch,
    then HF ``generate`` (Llama) or pipe.generate on a one-stage pipe (the zoo's GPT, itself
    checked against no-cache decoding elsewhere)."""
    make, _ = MODELS[name]
    model = make(layers)
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


def bad_call_body(rank: int, world: int, kwargs: dict, group: Any = None) -> str:
    """A bad generate() call on every rank: each returns the error it raised (none hangs)."""
    from pippy_split.generate import GenerationError

    _, _, sched = build("tiny_gpt", "1F1B", world, group)
    ids, mask = prompts(True, batch=3)
    try:
        sched.generate(ids % 64, attention_mask=mask, **kwargs)
    except GenerationError as e:
        return str(e)
    return "no error"


def trace_fails_on_one_rank_body(rank: int, world: int, group: Any = None) -> str:
    """Rank 0's decode trace raises, the other ranks' succeed: every rank returns what it raised
    (before the fix the others waited in their first receive until the group's timeout)."""
    from pippy_split.generate import programs

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected trace failure")

    _, _, sched = build("tiny_gpt", "1F1B", world, group)
    original = programs.trace_again
    if rank == 0:
        programs.trace_again = fail  # type: ignore[assignment]
    ids, mask = prompts(True, batch=3)
    try:
        sched.generate(ids % 64, attention_mask=mask, max_new_tokens=2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        programs.trace_again = original  # the next case of this spawn traces again
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


def generate_on_meta_body(rank: int, world: int, kwargs: dict, group: Any = None) -> torch.Tensor:
    """A pipe traced on a ``meta`` HF Llama, each rank's stages filled from the state dict
    (as a big model is built): generate reads shapes of the other ranks' layers only."""
    model = llama(layers_for(world))
    with torch.device("meta"):
        meta = type(model)(model.config).eval()
    ids, _ = train_batch()
    pipe = ps.pipeline(meta, layer_split("model.layers", layers_for(world), world), (ids[: 4 // N_MB],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=lm_loss, state_dict=model.state_dict(), group=group)
    prompt, mask = prompts(True, batch=5)
    return sched.generate(prompt % 64, attention_mask=mask, **kwargs).sequences


def retained_rounds_body(rank: int, world: int, group: Any = None) -> dict:
    """Generate 12 tokens in 2 lanes and record the most (lane, round) entries of stage values
    this rank's decode run held at once (before the fix a rank without the last stage kept
    every round's, each layer's cache included, until the call returned)."""
    from pippy_split.generate import distributed

    _, _, sched = build("tiny_gpt", "1F1B", world, group)
    held: list[int] = []
    original = distributed.DecodeRun.compute

    def compute(self: Any, a: Any) -> None:
        original(self, a)
        held.append(len(self.values))

    distributed.DecodeRun.compute = compute  # type: ignore[method-assign]
    try:
        ids, mask = prompts(True, batch=4)
        out = sched.generate(ids % 64, attention_mask=mask, max_new_tokens=12, lanes=2, eos_token_id=999)
    finally:
        distributed.DecodeRun.compute = original  # type: ignore[method-assign]
    return {"most_held": max(held), "computes": len(held), "sequences": out.sequences}


def eager_body(rank: int, world: int, schedule: str, stages: int, kwargs: dict, meta_on: int | None = None,
               group: Any = None) -> dict:
    """The Llama schedule after one SGD step, then ``sched.generate`` counting ``torch.export``
    calls (none where each stage runs the model's own modules: generate/eager.py). Rank
    ``meta_on`` holds its rotary embedding's ``inv_freq`` on meta (so it cannot decode eagerly):
    every rank returns what it raised."""
    from pippy_split.generate import GenerationError

    model, _, sched = build("llama", schedule, stages, group)
    _train_step(sched)
    if rank == meta_on:
        model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to("meta")
    calls = []
    real = torch.export.export
    torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[assignment]
    ids, mask = prompts(True, batch=5)
    try:
        out = sched.generate(ids % 64, attention_mask=mask, return_logprobs=True, **kwargs)
    except GenerationError as e:
        return {"raised": str(e), "exports": len(calls)}
    finally:
        torch.export.export = real  # type: ignore[assignment]
    return {"sequences": out.sequences, "logprobs": out.logprobs, "exports": len(calls)}
