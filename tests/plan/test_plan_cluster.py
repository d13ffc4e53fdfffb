"""ps.plan_cluster: a 405B config planned on 512 GPUs in seconds, refusals that name what
overflows, and the predictions set beside torchtitan's published Llama 3.1 figures
(docs/performance.md, Tables 4-6, torchtitan 9dec370 on torch 1963fc8, Dec 2024; copied with
their sources in benchmarks/llama3_h100_202412_torchtitan.md), with the efficiency factor
fitted once, on Table 5's 1F1B throughput, and held fixed for every other figure. How each
run is priced (torchtitan's microbatch count, split and runtime then) is
benchmarks/torchtitan_llama3.py's docstring; its helpers price the rows here.

Checks that hold are plain tests; those that do not are strict xfails whose reason gives the
figures, so a change that closes one turns it into a failure to promote."""

from __future__ import annotations

import json
import time

import pytest
import torch

import pippy_split as ps
from benchmarks.torchtitan_llama3 import LLAMA_405B as LLAMA_405B_SHAPE
from benchmarks.torchtitan_llama3 import (
    PUBLISHED_70B,
    PUBLISHED_405B,
    PUBLISHED_405B_32K,
    TITAN,
    fit_efficiency,
    price_70b,
    price_405b,
    titan_split,
)
from pippy_split.plan.cluster_costs import Layout, static_bytes
from pippy_split.plan.cluster_runtime import Runtime

GiB = 2**30
LLAMA_405B = {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248,
              "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256}
_405b = price_405b
_70b = price_70b


@pytest.fixture(scope="module")
def fitted() -> ps.Cluster:
    """The efficiency fitted once, on Table 5's 1F1B row (100 tokens/s/GPU), by bisection."""
    return fit_efficiency()


def test_titan_split_matches_generate_split_points():
    assert titan_split(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert titan_split(126, 16) == (7,) + (8,) * 14 + (7,)


def test_torchtitan_runtime_holds_fp32_gradients_and_kept_logits():
    """FSDP2 with reduce_dtype fp32 accumulates a PP stage's unsharded gradients in fp32, and
    the pipelining runtime of Dec 2024 kept every microbatch's fp32 logits on the last stage."""
    lay = Layout(pp=8, dp=8, tp=8, v=1, m=8, mb=4, ac=True)
    plain = static_bytes(LLAMA_405B_SHAPE, lay, 15, False, True, "adamw", Runtime(), 1, 8192)
    titan = static_bytes(LLAMA_405B_SHAPE, lay, 15, False, True, "adamw", TITAN, 1, 8192)
    unsharded = (15 * LLAMA_405B_SHAPE.layer_params + LLAMA_405B_SHAPE.vocab * LLAMA_405B_SHAPE.hidden) / 8
    assert titan["unsharded gradients (fp32)"] == pytest.approx(4 * unsharded)
    assert plain["unsharded gradients (bf16)"] == pytest.approx(2 * unsharded)
    assert titan["stage outputs kept until the step ends"] == pytest.approx(8 * 4 * 8192 * 128256 / 8 * 4)
    assert "stage outputs kept until the step ends" not in plain


def test_405b_plans_in_under_a_minute_from_a_config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_405B))
    t0 = time.perf_counter()
    plan = ps.plan_cluster(f"hf:{tmp_path}", ps.Cluster.preset("h100x512"), global_batch_tokens=256 * 8192,
                           seq_len=8192, dtype=torch.bfloat16, optimizer="adamw")
    assert time.perf_counter() - t0 < 60
    best = plan.best
    assert best.fits and best.layout.pp * best.layout.dp * best.layout.tp == 512
    assert "tokens/s/GPU" in str(plan) and "<table>" in plan._repr_html_()
    cmd = best.launch()
    assert cmd.startswith("torchrun --nnodes 64 --nproc-per-node 8") and f"--model hf:{tmp_path}" in cmd
    assert f"--dp {best.layout.dp} --tp {best.layout.tp}" in cmd


def test_transformers_config_reads_the_same():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**LLAMA_405B)
    assert ps.plan_cluster(cfg, ps.Cluster.preset("h100x512"), global_batch_tokens=64 * 8192, seq_len=8192,
                           schedules=["1F1B"]).best.fits


def test_refusal_names_the_overflow_and_a_knob():
    with pytest.raises(ValueError, match=r"no layout fits in .* GiB per GPU; closest: .* over by [0-9.]+ GiB; "
                                         r"largest: .*; try "):
        ps.plan_cluster(LLAMA_405B, ps.Cluster.preset("h100x8"), global_batch_tokens=8 * 8192, seq_len=8192)


def test_fitted_factor_and_schedule_order(fitted):
    """One factor reproduces the fitted row, and Interleaved1F1B beats 1F1B (a smaller
    bubble: 8 microbatches on 8 ranks, 7/15 of the step against 7/23)."""
    one = _405b(fitted, "1F1B", 1)
    inter = _405b(fitted, "Interleaved1F1B", 2)
    assert one.tokens_per_s_per_gpu == pytest.approx(100.0, rel=1e-3)
    assert 0.2 < fitted.efficiency < 0.8
    assert inter.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu and inter.bubble < one.bubble


def test_405b_throughput_ratio_within_10_percent(fitted):
    ratio = _405b(fitted, "Interleaved1F1B", 2).tokens_per_s_per_gpu / _405b(fitted, "1F1B", 1).tokens_per_s_per_gpu
    assert ratio == pytest.approx(PUBLISHED_405B["Interleaved1F1B"][0] / PUBLISHED_405B["1F1B"][0], rel=0.10)


def test_405b_interleaved_memory_within_10_percent(fitted):
    assert _405b(fitted, "Interleaved1F1B", 2).memory_bytes / GiB == pytest.approx(PUBLISHED_405B["Interleaved1F1B"][1], rel=0.10)


@pytest.mark.xfail(strict=True, reason="predicted 71.0 GiB vs published 82.5 (-14%): the model counts live tensors "
                   "(fullest GPU: the last rank, 15.7 GiB of it the 8 microbatches' fp32 logits the runtime kept); the "
                   "published figure is max_memory_reserved (allocator fragmentation not priced), and it falls from "
                   "1F1B to Interleaved1F1B (82.5 -> 72.7) where the model's rises (71.0 -> 79.0)")
def test_405b_1f1b_memory_within_10_percent(fitted):
    assert _405b(fitted, "1F1B", 1).memory_bytes / GiB == pytest.approx(PUBLISHED_405B["1F1B"][1], rel=0.10)


def test_405b_32k_table6_under_the_same_factor(fitted):
    """Table 6, FSDP 8 CP 1: seq 32768, local batch 8 (8 microbatches of 1), 1F1B; attention is
    4x the share of the fitted row's FLOPs."""
    got = _405b(fitted, "1F1B", 1, seq_len=32768, local_batch=8)
    assert got.tokens_per_s_per_gpu == pytest.approx(PUBLISHED_405B_32K[0], rel=0.10)
    assert got.memory_bytes / GiB == pytest.approx(PUBLISHED_405B_32K[1], rel=0.10)


@pytest.mark.parametrize("row", list(PUBLISHED_70B))
def test_70b_throughput_under_the_same_factor(fitted, row):
    """Both Table 4 rows: the model prices TP's collectives as not overlapped, so it predicts
    the same for both (async TP is not modelled; published gain 5.7%)."""
    assert _70b(fitted).tokens_per_s_per_gpu == pytest.approx(PUBLISHED_70B[row][0], rel=0.10)


@pytest.mark.xfail(strict=True, reason="predicted 59.4 GiB live tensors vs published 71.9 (-17%) and 67.6 (-12%) "
                   "reserved: 20 GiB of block inputs, 31 GiB at the loss's peak (fp32 logits and loss parallel's "
                   "three fp32 copies of 2.1e9 logits), 6 GiB of state; the allocator's reserve is not priced")
@pytest.mark.parametrize("row", list(PUBLISHED_70B))
def test_70b_memory_under_the_same_factor(fitted, row):
    assert _70b(fitted).memory_bytes / GiB == pytest.approx(PUBLISHED_70B[row][1], rel=0.10)


def test_overflow_knob_follows_the_largest_part():
    """Unsharded blocks ask for more pp or tp, not a finer shard (both names hold "sharded")."""
    from pippy_split.plan.cluster_search import _overflow

    lay = Layout(pp=2, dp=4, tp=1, v=1, m=4, mb=1, ac=True)
    assert "more pp or tp" in _overflow({"unsharded parameters (bf16)": 9e9, "x (sharded)": 1e9}, 8e9, lay)
    assert "finer shard" in _overflow({"parameters + grads + optimizer (sharded)": 9e9}, 8e9, lay)
    assert "microbatches" in _overflow({"stage outputs kept until the step ends": 9e9}, 8e9, lay)


def test_cli_plan_cluster_prints_the_table_and_launch(tmp_path, capsys):
    from pippy_split.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_405B))
    rc = main(["plan", "--cluster", "h100x512", "--model", f"hf:{tmp_path}", "--seq-len", "8192",
               "--global-batch-tokens", str(256 * 8192), "--top", "5"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens/s/GPU" in out and "torchrun --nnodes 64" in out
    rc = main(["plan", "--cluster", "h100x8", "--model", f"hf:{tmp_path}", "--seq-len", "8192",
               "--global-batch-tokens", str(8 * 8192)])
    assert rc == 2 and "over by" in capsys.readouterr().err


def test_cli_plan_cluster_prices_the_runtime_it_is_given(tmp_path, capsys):
    """--runtime torchtitan-2412 holds more per GPU (fp32 accumulated gradients, kept outputs)
    than pippy_split's own runtime on the same layouts; a name it does not know is refused."""
    from pippy_split.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_405B))
    base = ["plan", "--cluster", "h100x512", "--model", f"hf:{tmp_path}", "--seq-len", "8192",
            "--global-batch-tokens", str(256 * 8192), "--top", "1"]
    tables = {}
    for name in ("pippy_split", "torchtitan-2412"):
        assert main(base + ["--runtime", name]) == 0
        tables[name] = capsys.readouterr().out
    assert tables["pippy_split"] != tables["torchtitan-2412"]
    assert main(base + ["--runtime", "megatron"]) == 2
    assert "unknown runtime preset 'megatron'" in capsys.readouterr().err


def test_readme_figures(fitted):
    """The figures docs/cluster_planning.md's "Against published results" table prints (predicted, under the
    factor fitted on Table 5's 1F1B row): a change to the cost model must update both."""
    one, inter = _405b(fitted, "1F1B", 1), _405b(fitted, "Interleaved1F1B", 2)
    long = _405b(fitted, "1F1B", 1, seq_len=32768, local_batch=8)
    got70 = _70b(fitted)
    assert round(fitted.efficiency, 2) == 0.42
    assert round(inter.tokens_per_s_per_gpu) == 131 and round(long.tokens_per_s_per_gpu) == 83
    assert round(one.memory_bytes / GiB, 1) == 71.0 and round(inter.memory_bytes / GiB, 1) == 79.0
    assert round(long.memory_bytes / GiB, 1) == 71.0
    assert round(got70.tokens_per_s_per_gpu) == 891 and round(got70.memory_bytes / GiB, 1) == 59.4
