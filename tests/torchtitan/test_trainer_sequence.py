"""torchtitan's Llama 3, Qwen3 and DeepSeek-V3 (tiny, on CPU) under torchtitan's Trainer sequence
on gloo ranks, through pippy_split's ``pipeline_llm`` and through the compat route inside
torchtitan's own ``pipeline_llm``: losses, every parameter after two optimizer steps (SGD, the
Trainer's ``clip_grad_norm_`` with the pp mesh) and the MoE load counters equal the unsplit model's
(fp32, atol 1e-5), and the Validator's
``eval(arg_mbs=, kwarg_mbs=, target_mbs=, losses=)`` after them; ``sched.generate`` on the trained
stages of Llama 3 and DeepSeek-V3 (``pipeline_llm``, 1F1B and ZBVZeroBubble) equals a greedy loop
over the unsplit trained model's full forward of the growing sequence. The 2-rank cases share one spawn of the ranks, the 4-rank (PP x FSDP2) cases
another."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'pippy-split[torchtitan]' "
                                         "and, on CPU, pip install --no-deps triton==3.8.0)")

from pippy_split.testing import run_ranks  # noqa: E402

from .bodies import (  # noqa: E402
    GEN_NEW,
    case_results,
    cases_body,
    gen_prompts,
    greedy_reference,
    reference,
    reference_model,
    trainer_replay,
)

ATOL = 1e-5
TWO = [  # (model, route, schedule)
    ("llama3", "pipeline_llm", "1F1B"),
    ("llama3", "pipeline_llm", "ZBVZeroBubble"),
    ("qwen3", "pipeline_llm", "DualPipeV"),
    ("qwen3", "pipeline_llm", "Interleaved1F1B"),
    ("llama3", "compat", "1F1B"),
    ("qwen3", "compat", "ZBVZeroBubble"),
    ("deepseek_v3", "pipeline_llm", "1F1B"),
    ("deepseek_v3", "pipeline_llm", "ZBVZeroBubble"),
    ("deepseek_v3", "compat", "1F1B"),
    ("deepseek_v3", "compat", "ZBVZeroBubble"),
    ("llama3", "pipeline_llm", "ZBVZeroBubble", 1, 4, True),  # torchtitan's full AC through its parallelize_fn
    ("llama3", "pipeline_llm", "1F1B", 1, 4, False, 1, True),  # its per-block torch.compile
]
AC, COMPILED = TWO[-2], TWO[-1]
GENERATE = [TWO[0], TWO[1], TWO[6], TWO[7]]  # then sched.generate on the trained stages
FOUR = [  # (model, route, schedule, fsdp, layers, ac, tp, compile, sp): PP2 x FSDP2, PP4, PP2 x TP2
    ("llama3", "pipeline_llm", "1F1B", 2),
    ("deepseek_v3", "compat", "Interleaved1F1B", 2),
    ("qwen3", "pipeline_llm", "1F1B", 1),
    ("llama3", "pipeline_llm", "ZBVZeroBubble", 1, 4, True, 2),  # sequence parallel, full AC; ZBV's I runs all of B
    ("deepseek_v3", "pipeline_llm", "1F1B", 1, 4, False, 2, False, False),  # no sequence parallelism: replicated
    ("qwen3", "compat", "1F1B", 1, 4, False, 2),  # torchtitan's own split, its parts' DTensors across the cut
]
TP = [c for c in FOUR if len(c) > 6 and c[6] > 1]


def _key(case: tuple) -> str:
    return "-".join(str(c) for c in case)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    generating = functools.partial(trainer_replay, generate=True)
    return run_ranks(cases_body, 2, {_key(c): (generating if c in GENERATE else trainer_replay, c) for c in TWO},
                     timeout=840)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(cases_body, 4, {_key(c): (trainer_replay, c) for c in FOUR}, timeout=840)


def _check(results: list[dict], name: str, dp: int = 1) -> None:
    ref = reference(name, 4, dp)
    last = [r for r in results if r["has_last"] and r["dp_rank"] == 0]  # losses: data-parallel rank 0's rows
    assert sum(r["has_first"] for r in results) >= 1 and last
    for r in last:
        for got, want in zip(r["losses"], ref["losses"]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(r["eval"], ref["eval"], atol=1e-4, rtol=0)  # a sum over 32 tokens
    params: dict = {}
    for r in results:
        assert r["finite"], "init_weights left a non-finite value"
        params.update(r["params"])
    assert set(params) == set(ref["params"])
    for k, want in ref["params"].items():
        torch.testing.assert_close(params[k], want, atol=ATOL, rtol=0, msg=k)
    for step, want in enumerate(ref["counters"]):  # MoE tokens_per_expert after each step's forward,
        got: dict = {}                               # summed over data-parallel ranks (the reference saw every row)
        for r in (r for r in results if r.get("tp_rank", 0) == 0):  # tp ranks hold the same counts
            for k, v in r["counters"][step].items():
                got[k] = got[k] + v if k in got else v
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), f"step {step}, {k}: {got[k].tolist()} vs {want[k].tolist()}"
    ropes = {k: v for r in results for k, v in r["ropes"].items()}  # computed by init_weights after to_empty
    want_ropes = dict(reference_model(name, 4).named_buffers())
    assert ropes and all(torch.equal(v, want_ropes[k]) for k, v in ropes.items())


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", TWO, ids=[_key(c) for c in TWO])
def test_trainer_sequence_on_two_ranks_equals_unsplit(two_ranks, case) -> None:
    _check(case_results(two_ranks, _key(case)), case[0])


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FOUR, ids=[_key(c) for c in FOUR])
def test_four_ranks_equal_unsplit(four_ranks, case) -> None:
    _check(case_results(four_ranks, _key(case)), case[0], dp=case[3])  # tp ranks: each checked whole


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["two", "four"])
def test_full_ac_is_what_runs(two_ranks, four_ranks, where) -> None:
    """torchtitan's full AC wrapped every block of every part, and each wrapped block ran twice a
    microbatch in the first step (its forward, its recompute in backward): no wrapper dropped."""
    results = case_results(two_ranks, _key(AC)) if where == "two" else case_results(four_ranks, _key(FOUR[3]))
    for r in results:
        ran = r["ran"]
        assert ran["blocks"] > 0 and ran["checkpointed_blocks"] == ran["blocks"], ran
        assert ran["checkpointed_forwards"] == 2 * ran["blocks"] * ran["microbatches"], ran


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_compiled_blocks_are_what_runs(two_ranks) -> None:
    """torchtitan's per-block torch.compile: each block's compiled graph ran once a microbatch in the
    first step's forward (a counting backend), and the run above is exact with it."""
    for r in case_results(two_ranks, _key(COMPILED)):
        ran = r["ran"]
        assert ran["blocks"] > 0 and ran["compiled_runs"] == ran["blocks"] * ran["microbatches"], ran


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", TP, ids=[_key(c) for c in TP])
def test_tensor_parallel_shards_every_stage(four_ranks, case) -> None:
    """Under pp2 x tp2, torchtitan's parallelize() sharded weights of every part over tp (the
    exactness of the same run is checked above)."""
    for r in case_results(four_ranks, _key(case)):
        assert r["tp_sharded"], f"rank holds no tp-sharded weight: {r['tp_sharded']}"


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", GENERATE, ids=[_key(c) for c in GENERATE])
def test_generate_on_trained_stages_equals_greedy_full_forward(two_ranks, case) -> None:
    """torchtitan's Decoder takes no KV cache: it decodes by recomputing the prefix each step, on
    the stages the Trainer's sequence trained; every rank returns the tokens a greedy loop over the
    unsplit model (same two optimizer steps) chooses, log-probabilities to 1e-5; prompts of
    unequal length were refused by name on every rank first."""
    model = reference_model(case[0], 4)
    model.load_state_dict(reference(case[0], 4)["params"], strict=False)
    want, want_logprobs = greedy_reference(model.eval(), gen_prompts(), GEN_NEW)
    for r in case_results(two_ranks, _key(case)):
        got = r["generated"]
        assert torch.equal(got["sequences"], want)
        torch.testing.assert_close(got["logprobs"], want_logprobs, atol=1e-5, rtol=0)
        assert "prompts of one length" in got["padded_refused"], got["padded_refused"]


def test_torchtitan_refuses_tied_embeddings_with_pp_itself() -> None:
    """Why pipeline_llm refuses enable_weight_tying: the Trainer's update_from_config refuses it
    with pp > 1 before any pipelining_fn runs (pipeline_llm also names what the Trainer would
    get wrong past it; tests/torchtitan/test_refusals.py)."""
    from types import SimpleNamespace

    from torchtitan.config import ParallelismConfig

    from .models import config

    cfg = config("qwen3")
    cfg.enable_weight_tying = True
    with pytest.raises(NotImplementedError, match="Weight tying is not supported with Pipeline Parallel"):
        cfg.update_from_config(config=SimpleNamespace(parallelism=ParallelismConfig(pipeline_parallel_degree=2)))
