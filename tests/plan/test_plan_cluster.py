"""ps.plan_cluster: a 405B config planned on 512 GPUs in seconds, refusals that name what
overflows, and the predictions set beside torchtitan's published Llama 3.1 figures
(docs/performance.md, Tables 4-6, torchtitan 9dec370 on torch 1963fc8, Dec 2024; copied with
their sources in benchmarks/llama3_h100_202412_torchtitan.md) under the planner's one set of
constants, no factor fitted per row. How each run is priced (torchtitan's microbatch count,
split and runtime then) is benchmarks/torchtitan_llama3.py's docstring; every other published
row is checked in test_plan_cluster_published.py."""

from __future__ import annotations

import json

import pytest
import torch

import pippy_split as ps
from benchmarks.torchtitan_llama3 import LLAMA_405B as LLAMA_405B_SHAPE
from benchmarks.torchtitan_llama3 import (
    PUBLISHED_70B,
    PUBLISHED_405B,
    PUBLISHED_405B_32K,
    TITAN_FP8,
    price_70b,
    price_405b,
    titan_split,
)
from pippy_split.plan.cluster import ClusterLayout, Runtime
from pippy_split.plan.cluster.memory import static_bytes
from pippy_split.plan.cluster.search import _overflow

GiB = 2**30
LLAMA_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
LLAMA_405B = {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248,
              "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256}


def test_titan_split_matches_generate_split_points():
    assert titan_split(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert titan_split(126, 16) == (7,) + (8,) * 14 + (7,)


def test_torchtitan_runtime_holds_fp32_gradients_and_kept_logits():
    """FSDP2 with reduce_dtype fp32 accumulates a PP stage's unsharded gradients in fp32, and
    the pipelining runtime of Dec 2024 kept every microbatch's fp32 logits on the last stage."""
    lay = ClusterLayout(pp=8, dp=8, tp=8, v=1, m=8, mb=4, ac=True)
    plain = static_bytes(LLAMA_405B_SHAPE, lay, 15, False, True, "adamw", Runtime(), 1, 8192)
    titan = static_bytes(LLAMA_405B_SHAPE, lay, 15, False, True, "adamw", TITAN_FP8, 1, 8192)
    unsharded = (15 * LLAMA_405B_SHAPE.layer_params + LLAMA_405B_SHAPE.vocab * LLAMA_405B_SHAPE.hidden) / 8
    assert titan["unsharded gradients (fp32)"] == pytest.approx(4 * unsharded)
    assert plain["unsharded gradients (bf16)"] == pytest.approx(2 * unsharded)
    assert titan["stage outputs kept until the step ends"] == pytest.approx(8 * 4 * 8192 * 128256 / 8 * 4)
    assert "stage outputs kept until the step ends" not in plain


@pytest.mark.timeout(120)
def test_405b_plans_from_a_config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_405B))
    plan = ps.plan_cluster(f"hf:{tmp_path}", ps.Cluster.preset("h100x512"), global_batch_tokens=256 * 8192,
                           seq_len=8192, dtype=torch.bfloat16, optimizer="adamw")
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


def test_schedule_order_under_one_set_of_constants():
    """Interleaved1F1B beats 1F1B (a smaller bubble: 8 microbatches on 8 ranks, 7/15 of the
    step against 7/23), with nothing fitted to either row."""
    one, inter = price_405b("1F1B"), price_405b("Interleaved1F1B")
    assert inter.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu and inter.bubble < one.bubble


@pytest.mark.parametrize("schedule", list(PUBLISHED_405B))
def test_405b_table5_within_15_percent(schedule):
    got = price_405b(schedule)
    assert got.tokens_per_s_per_gpu == pytest.approx(PUBLISHED_405B[schedule][0], rel=0.15)


def test_405b_throughput_ratio_within_10_percent():
    ratio = price_405b("Interleaved1F1B").tokens_per_s_per_gpu / price_405b("1F1B").tokens_per_s_per_gpu
    assert ratio == pytest.approx(PUBLISHED_405B["Interleaved1F1B"][0] / PUBLISHED_405B["1F1B"][0], rel=0.10)


def test_405b_interleaved_memory_within_15_percent():
    assert price_405b("Interleaved1F1B").memory_bytes / GiB == pytest.approx(PUBLISHED_405B["Interleaved1F1B"][1],
                                                                            rel=0.15)


def test_405b_1f1b_memory_within_15_percent():
    """Was a strict xfail (live tensors 71.0 GiB against 82.5 reserved, -14% at the 10% the
    issue-33 check used): the reserve the caching allocator keeps beyond the live peak is priced
    now; the issue-43 bar is 15%."""
    assert price_405b("1F1B").memory_bytes / GiB == pytest.approx(PUBLISHED_405B["1F1B"][1], rel=0.15)


def test_405b_1f1b_reserves_more_than_interleaved_as_published():
    """Table 5: 82.5 GiB under 1F1B, 72.7 under Interleaved1F1B. A stage's unsharded gradients
    live from its first backward to its last: on 1F1B's ranks they arrive while the warm-up
    microbatches are held. (Before, counted as held all step, 1F1B came out 8 GiB lower.)"""
    one, inter = price_405b("1F1B"), price_405b("Interleaved1F1B")
    assert one.memory_bytes > inter.memory_bytes
    assert one.memory_bytes - inter.memory_bytes > 2 * GiB


def test_405b_32k_table6_under_the_same_constants():
    """Table 6, FSDP 8 CP 1: seq 32768, local batch 8 (8 microbatches of 1), 1F1B; attention is
    4x the share of Table 5's FLOPs."""
    got = price_405b("1F1B", seq_len=32768)
    assert got.tokens_per_s_per_gpu == pytest.approx(PUBLISHED_405B_32K[0], rel=0.15)
    assert got.memory_bytes / GiB == pytest.approx(PUBLISHED_405B_32K[1], rel=0.15)


@pytest.mark.parametrize("row", list(PUBLISHED_70B))
def test_70b_throughput_under_the_same_constants(row):
    assert price_70b(row.endswith("AsyncTP")).tokens_per_s_per_gpu == pytest.approx(PUBLISHED_70B[row][0], rel=0.15)


@pytest.mark.parametrize("row", list(PUBLISHED_70B))
def test_70b_memory_under_the_same_constants(row):
    """Was a strict xfail (59.4 GiB live against 71.9 and 67.6 reserved): now the reserve is priced."""
    assert price_70b(row.endswith("AsyncTP")).memory_bytes / GiB == pytest.approx(PUBLISHED_70B[row][1], rel=0.15)


def test_async_tp_gain_within_10_percent_of_table4():
    """Async TP overlaps TP's transfers with the matmuls it feeds: published +5.7% on Table 4."""
    gain = price_70b(True).tokens_per_s_per_gpu / price_70b(False).tokens_per_s_per_gpu
    assert gain > 1.0 and gain == pytest.approx(PUBLISHED_70B["2D + AsyncTP"][0] / PUBLISHED_70B["2D"][0], rel=0.10)


def test_overflow_knob_follows_the_largest_part():
    """Unsharded blocks ask for more pp or tp, not a finer shard (both names hold "sharded")."""
    lay = ClusterLayout(pp=2, dp=4, tp=1, v=1, m=4, mb=1, ac=True)
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

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    base = ["plan", "--cluster", "h100x64", "--model", f"hf:{tmp_path}", "--seq-len", "8192",
            "--global-batch-tokens", str(64 * 8192), "--top", "10"]
    tables = {}
    for name in ("pippy_split", "torchtitan-2412"):
        assert main(base + ["--runtime", name]) == 0
        tables[name] = capsys.readouterr().out
    assert tables["pippy_split"] != tables["torchtitan-2412"]
    assert main(base + ["--runtime", "megatron"]) == 2
    assert "unknown runtime preset 'megatron'" in capsys.readouterr().err
