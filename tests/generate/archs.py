"""Every causal LM the project trains, as generation sees it: how to build each (tiny, from a
config, nothing downloaded), where to cut it between blocks, its prompts and its reference
(greedy Hugging Face ``generate`` on the unsplit model), whether it decodes with a KV cache or a
recurrent state; every one generates (none refused).

The real-architecture matrix's causal LMs (``tests/models/hf_archs.py``, built with the config
they train with: Qwen2-MoE's router aux loss on), the balance matrix's (``tests/models/hf.py``:
Mixtral, Gemma2, Llama, GPT-2) and four families kept back as a check: OLMoE with its router
aux loss on (as a MoE is trained), MPT (ALiBi: no ``position_ids``), RWKV (``state=``) and
Zamba (Mamba layers and a shared attention block)."""

from __future__ import annotations

from typing import Callable

import torch

MATRIX = ["qwen3", "qwen2_moe", "phi3", "mistral_tied", "gpt_neox", "opt", "bloom", "falcon", "granite",
          "deepseek_v3", "mamba", "mamba6", "jamba", "recurrent_gemma"]
BALANCE = ["mixtral", "gemma2"]
RECURRENT: set[str] = set()
"""Refused by name at generate's first line: none (RWKV was, until issue 39 carried its ``state=``)."""
STATEFUL = {"mamba", "mamba6", "jamba", "zamba", "recurrent_gemma", "rwkv"}
"""A recurrent state (conv / SSM / RG-LRU / RWKV states): decoded by a prefill and a step program
(``pippy_split/generate/phased.py``), equal to Hugging Face generate."""
ONE_LENGTH = {"rwkv"}
"""Prompts of one length, no padding: RWKV reads no attention mask (left padding would change
its state; the pipe refuses a mask with zeros by name), and Hugging Face's batched RWKV step
mixes the rows (each row's one-token step broadcasts over every row's token-shift state), so its
reference is ``generate`` on each prompt alone (:func:`reference`)."""
VOCAB = 128


def olmoe() -> torch.nn.Module:
    import transformers as t

    cfg = t.OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, output_router_logits=True)
    return t.OlmoeForCausalLM(cfg)


def mpt() -> torch.nn.Module:
    import transformers as t

    return t.MptForCausalLM(t.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=4, max_seq_len=64))


def rwkv() -> torch.nn.Module:
    import transformers as t

    return t.RwkvForCausalLM(t.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                          attention_hidden_size=32, intermediate_size=64, context_length=64))


def zamba() -> torch.nn.Module:
    import transformers as t

    cfg = t.ZambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, attention_head_dim=16, mamba_d_state=4,
                        mamba_d_conv=4, mamba_expand=2, n_mamba_heads=1, max_position_embeddings=64,
                        tie_word_embeddings=False)
    return t.ZambaForCausalLM(cfg)


KEPT_BACK: dict[str, Callable[[], torch.nn.Module]] = {"olmoe": olmoe, "mpt": mpt, "rwkv": rwkv, "zamba": zamba}
NAMES = [*MATRIX, *BALANCE, *KEPT_BACK]


def build(name: str) -> torch.nn.Module:
    """The named causal LM, seeded, in eval mode."""
    torch.manual_seed(0)
    if name in KEPT_BACK:
        model = KEPT_BACK[name]()
    elif name in BALANCE:
        from tests.models import hf

        model = hf.build(name)[0]
    else:
        from tests.models import hf_archs

        model = hf_archs.build(name).model
    return model.eval()


def blocks(model: torch.nn.Module) -> str:
    """The FQN of the model's repeated blocks (its first ModuleList of two or more)."""
    return next(n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2)


def mid_cut(model: torch.nn.Module) -> list[str]:
    """One cut between blocks, half-way."""
    fqn = blocks(model)
    return [f"{fqn}.{len(model.get_submodule(fqn)) // 2}"]


def cuts(model: torch.nn.Module, stages: int) -> list[str]:
    """``stages - 1`` cuts between blocks, spread evenly."""
    fqn = blocks(model)
    n = len(model.get_submodule(fqn))
    return [f"{fqn}.{(i * n) // stages}" for i in range(1, stages)]


def arch_prompts(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``name``'s prompts: left-padded, or of one length for :data:`ONE_LENGTH`."""
    from .models import prompts

    return prompts(name not in ONE_LENGTH)


def reference(name: str, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``generate``'s greedy sequences and log-probabilities on the unsplit model: on the batch,
    or for :data:`ONE_LENGTH` on each prompt alone (finished rows padded with the pad HF uses)."""
    from .models import hf_reference

    if name not in ONE_LENGTH:
        return hf_reference(model, ids, mask, n, **hf_kwargs(model))
    rows = [hf_reference(model, ids[i:i + 1], mask[i:i + 1], n) for i in range(ids.shape[0])]
    width = max(r.shape[1] for r, _ in rows)
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    pad = pad if pad is not None else (eos if isinstance(eos, int) else eos[0] if eos else 0)
    sequences = torch.full((len(rows), width), pad, dtype=ids.dtype)
    logprobs = torch.zeros(len(rows), width - ids.shape[1])
    for i, (r, lp) in enumerate(rows):
        sequences[i, : r.shape[1]] = r[0]
        logprobs[i, : lp.shape[1]] = lp[0]
    return sequences, logprobs


def arch_generate_body(rank: int, world: int, name: str, schedule: str, stages: int, kwargs: dict,
                       group: object = None) -> dict:
    """``name`` cut into ``stages`` stages between blocks, ``schedule`` on these ranks, greedy
    generate on every rank."""
    import pippy_split as ps

    from .gen_bodies import lm_loss

    model = build(name)
    ids, mask = arch_prompts(name)
    pipe = ps.pipeline(model, cuts(model, stages), (ids[:2],))
    sched = ps.build_schedule(pipe, schedule, 2, loss_fn=lm_loss, group=group)
    out = sched.generate(ids, attention_mask=mask, return_logprobs=True, **kwargs)
    return {"sequences": out.sequences, "logprobs": out.logprobs}


def hf_kwargs(model: torch.nn.Module) -> dict:
    """What HF generate needs to decode ``model`` as the pipe does: HF's own cached generate fails
    with left-padded prompts while a MoE's router aux loss is on (its loss reads the whole mask
    beside the new tokens' router logits), so the reference switches it off, as the pipe's
    decode step does."""
    return {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}


def generation_check(name: str, n_new: int = 6) -> tuple[str, str]:
    """``(verdict, detail)`` of ``pipe.generate`` on ``name`` cut between blocks into 2 stages,
    against HF generate on the unsplit model (greedy, left-padded prompts, :func:`arch_prompts`;
    :func:`reference`): ``"equal"`` (tokens
    equal, log-probabilities within 1e-5 up to each row's EOS), ``"refused"`` (a GenerationError
    naming a recurrent state), else ``"differs"`` / ``"raised"`` with what differed or raised;
    the detail ends with the decode program that ran (``eager``: the model's own modules,
    :mod:`pippy_split.generate.eager`; ``traced``).
    The real-architecture benchmark's generation column and ``test_generate_archs`` use it."""
    import pippy_split as ps
    from pippy_split.generate import GenerationError

    from .test_generate_local import _live

    model = build(name)
    ids, mask = arch_prompts(name)
    pipe = ps.pipeline(model, mid_cut(model), (ids[:2],))
    try:
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=n_new, return_logprobs=True)
    except GenerationError as e:
        return ("refused" if "recurrent state" in str(e) else "raised"), str(e)
    ref, ref_logprobs = reference(name, model, ids, mask, n_new)
    if not torch.equal(out.sequences[:, : ref.shape[1]], ref):
        return "differs", f"tokens differ: {out.sequences.tolist()} vs {ref.tolist()}"
    n = ref.shape[1] - ids.shape[1]
    live = _live(ref[:, ids.shape[1]:], model.generation_config.eos_token_id)  # HF pads a row after its EOS
    err = float((out.logprobs[:, :n][live] - ref_logprobs[live]).abs().max()) if bool(live.any()) else 0.0
    how = "eager" if pipe.derived.get("eager_program") is not None else "traced"  # which decode program ran
    return ("equal", f"{err:.1e} {how}") if err <= 1e-5 else ("differs", f"log-probabilities differ by {err:.1e} ({how})")
