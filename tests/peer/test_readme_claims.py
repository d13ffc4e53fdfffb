"""Every claim README.md makes about torch.distributed.pipelining (the peer), run against it.

Each test runs the peer (2.13) and asserts the behaviour the README's comparison table or
performance table states. When the peer behaves otherwise the test is skipped with a
message saying the README must be updated, so the suite stays green and says so.
The multi-rank cases run on gloo through ``run_ranks``; their bodies live in
``tests/peer/bodies.py`` and reuse ``benchmarks.traffic``'s models and peer runner.

Run: python -m pytest tests/peer -q -p no:cacheprovider
"""

from __future__ import annotations

import warnings

import pytest
import torch

from pippy_split.testing import RankFailure, run_ranks
from tests.peer import bodies

tdp = pytest.importorskip("torch.distributed.pipelining")


def _stale(claim: str, actual: str) -> None:
    pytest.skip(f"README must be updated: it says the peer {claim}, but torch {torch.__version__}: {actual}")


def _peer_error(fn, world: int, *args) -> str | None:
    """The root-cause line of the first failing rank, or None when every rank finished."""
    try:
        run_ranks(fn, world, *args, timeout=120)
    except RankFailure as e:
        text = next(iter(e.failures.values()), str(e))
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        return next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), lines[-1] if lines else "")
    return None


# ---- pure: no process group ----------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_arguments_used_out_of_order_are_silently_swapped():
    """README: 'arguments used out of order' -> 'silently swapped'. forward(x, y) reads y
    first; the peer's stage 0 takes its inputs in the order the graph first uses them,
    (y, x), and step(x, y) passes them positionally: GPipe on 2 ranks runs without an error
    and returns model(y, x)."""
    _, r1 = run_ranks(bodies.arg_order, 2, timeout=120)
    if torch.allclose(r1["out"], r1["model"]):
        _stale("silently swaps arguments used out of order", "the step returns model(x, y)")
    torch.testing.assert_close(r1["out"], r1["swapped"])


@pytest.mark.timeout(120)
def test_hf_causal_lm_with_default_use_cache_is_refused():
    """README: HF causal LMs with the default use_cache=True -> 'refuses until use_cache=False'."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    assert cfg.use_cache
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    spec = {"model.layers.1": tdp.SplitPoint.BEGINNING}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tdp.pipeline(transformers.LlamaForCausalLM(cfg), mb_args=(ids,), split_spec=spec)
        except Exception as e:  # noqa: BLE001 -- any refusal is what the README says
            refused = f"{type(e).__name__}: {e}"
        else:
            refused = None
        if refused is None:
            _stale("refuses HF causal LMs until use_cache=False", "tdp.pipeline accepts the default config")
        cfg.use_cache = False
        pipe = tdp.pipeline(transformers.LlamaForCausalLM(cfg), mb_args=(ids,), split_spec=spec)
    assert pipe.num_stages == 2, refused


# ---- two or three gloo ranks ----------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_hand_built_stage_without_input_args_runs_a_forward_on_uninitialised_memory():
    """README: hand-built stages without input_args -> 'runs a forward on uninitialised memory'.
    Stage 1's module is called once more than there are microbatches; the extra first call's
    input is a real (not meta, not fake) tensor made from shape metadata alone, equal to none of
    the activations stage 0 sends."""
    r0, r1 = run_ranks(bodies.uninitialised_forward, 2, timeout=120)
    assert r0["calls"] == bodies.N_MB + 1 and r0["first_equals_model_data"]  # stage 0: a real microbatch
    if r1["calls"] == bodies.N_MB:
        _stale("runs a forward on uninitialised memory", "no extra forward on stage 1")
    assert r1["calls"] == bodies.N_MB + 1
    assert not r1["first_is_meta"] and not r1["first_equals_a_real_input"]


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("build", ["hand-built ZBVZeroBubble", "traced InterleavedZeroBubble"])
def test_zero_bubble_split_with_a_parameter_used_twice_is_exact(build):
    """README: zero-bubble I/W split with a parameter used twice in a stage -> the peer is
    exact too (2.13; the README once said it double counts). Stage 0 applies one Linear twice."""
    if build.startswith("hand"):
        results = run_ranks(bodies.zero_bubble_twice, 2, timeout=120)
        pairs = {(s, n): v for r in results for s, d in r.items() for n, v in d.items()}
    else:
        results = run_ranks(bodies.zero_bubble_twice_traced, 2, "InterleavedZeroBubble", timeout=120)
        pairs = {k: v for r in results for k, v in r.items()}
    assert len(pairs) == 8  # 4 stages x (weight, bias)
    for key, (got, want) in pairs.items():
        if not torch.allclose(got, want, atol=1e-6, rtol=1e-5):
            ratio = (got.norm() / want.norm()).item()
            _stale("is exact here", f"{build}: {key} gradient is {ratio:.3f}x the unsplit model's")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_float_no_grad_edge_gets_a_gradient():
    """README: no-grad values between stages -> 'sends a gradient for a float no-grad edge
    (measured: +32 KB/step, 2x the backward bytes)'. float_table, 1F1B, 2 ranks, m=4: the
    only gradient needed is h's, 2x32x32 fp32 = 8 KiB per microbatch = 32 KiB per step;
    everything rank 1 sends is backward."""
    need = bodies.N_MB * 2 * 32 * 32 * 4
    results = run_ranks(bodies.traffic_peer, 2, "float_table", "1F1B", bodies.N_MB, 1, timeout=120)
    sent = results[1]["steps"][0]["sent_bytes"]
    if sent == need:
        _stale("sends a gradient for a float no-grad edge", f"rank 1 sent only the needed {need} B")
    assert sent - need == 32768 and sent == 2 * need, sent


CANNOT_RUN = [
    # README row, traffic case, schedule, ranks, the peer's error quoted there
    ("skip connection to a non-adjacent stage / fan_out_skip", "fan_out_skip", "1F1B", 3,
     "PipeliningMetadataError: Backward of skip connections not supported yet"),
    ("tiny_unet_v (skips 0->2, 0->3), V placement", "tiny_unet_v", "ZBVZeroBubble", 2,
     "TypeError: forward() missing 1 required positional argument: 'silu_2'"),
    ("a model input read by a later stage / tiny_llama", "tiny_llama", "1F1B", 2,
     "_retrieve_recv_activations expected non-root _RecvInfo but got root arg"),
]


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("row, case, schedule, world, expected", CANNOT_RUN, ids=[c[1] for c in CANNOT_RUN])
def test_cannot_run(row, case, schedule, world, expected):
    """README: the 'cannot run' rows, with the peer's error as the README quotes it."""
    error = _peer_error(bodies.traffic_peer, world, case, schedule, 4, 1)
    if error is None:
        _stale(f"cannot run {row} ({expected!r})", "it ran")
    if expected not in error:
        _stale(f"fails on {row} with {expected!r}", f"it fails with {error!r}")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_another_sequence_length_than_traced_fails():
    """README: microbatches of different lengths -> 'one length per pipe: a step at another
    length than traced fails'. The peer sizes its receive buffers from the traced example
    (stage 0's backward gets a (2, 16, 8) gradient for its (2, 8, 8) output)."""
    error = _peer_error(bodies.other_length, 2)
    if error is None:
        _stale("fails on a step at another length than traced", "the step ran")
