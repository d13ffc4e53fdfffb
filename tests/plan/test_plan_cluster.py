"""ps.plan_cluster: a 405B config planned on 512 GPUs in seconds, refusals that name what
overflows, and the predictions set beside torchtitan's published Llama 3.1 figures
(docs/performance.md, Tables 4 and 5, torchtitan 9dec370, Dec 2024) with the efficiency
factor fitted once, on Table 5's 1F1B throughput, and held fixed for every other figure.

The published checks the issue asks for (Interleaved/1F1B ratio within 10% of 1.28, each
memory within 10%) do NOT hold under this cost model today; they are strict xfails, so the
gap stays visible and a fix that closes it turns them into failures to promote."""

from __future__ import annotations

import json
import time

import pytest
import torch

import pippy_split as ps
from pippy_split.plan.cluster_costs import Layout
from pippy_split.plan.cluster_model import ModelShape
from pippy_split.plan.cluster_search import evaluate

GiB = 2**30
LLAMA_405B = {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248,
              "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256}
LLAMA_70B = ModelShape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256)
# torchtitan's published rows (Table 5: 405B, 512 H100 96GB, FSDP 8 TP 8 PP 8, local batch 32,
# seq 8192, full AC; Table 4: 70B, 256 GPUs, FSDP 32 TP 8, local batch 16, full AC, no async TP)
PUBLISHED_405B = {"1F1B": (100.0, 82.5), "Interleaved1F1B": (128.0, 72.7)}
PUBLISHED_70B = (829.0, 71.9)


def _405b(cluster: ps.Cluster, name: str, v: int):
    return evaluate(ModelShape(layers=126, hidden=16384, intermediate=53248, heads=128, kv_heads=8, vocab=128256),
                    cluster, Layout(pp=8, dp=8, tp=8, v=v, m=32, mb=1, ac=True), name, 8192)


@pytest.fixture(scope="module")
def fitted() -> ps.Cluster:
    """The efficiency fitted once, on Table 5's 1F1B row (100 tokens/s/GPU), by bisection."""
    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _405b(ps.Cluster.preset("h100-96gb", gpus=512, efficiency=mid), "1F1B", 1).tokens_per_s_per_gpu < 100:
            lo = mid
        else:
            hi = mid
    return ps.Cluster.preset("h100-96gb", gpus=512, efficiency=(lo + hi) / 2)


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
    """What holds: one factor reproduces the fitted row, and Interleaved1F1B beats 1F1B (a
    smaller bubble) as published."""
    one = _405b(fitted, "1F1B", 1)
    inter = _405b(fitted, "Interleaved1F1B", 2)
    assert one.tokens_per_s_per_gpu == pytest.approx(100.0, rel=1e-3)
    assert 0.2 < fitted.efficiency < 0.8
    assert inter.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu and inter.bubble < one.bubble


@pytest.mark.xfail(strict=True, reason="predicted Interleaved/1F1B ratio 1.11 vs published 1.28 (13% short): "
                   "the bubble alone (p=8, m=32: 19% vs 9%) cannot give 1.28")
def test_405b_throughput_ratio_within_10_percent(fitted):
    ratio = _405b(fitted, "Interleaved1F1B", 2).tokens_per_s_per_gpu / _405b(fitted, "1F1B", 1).tokens_per_s_per_gpu
    assert ratio == pytest.approx(128 / 100, rel=0.10)


@pytest.mark.xfail(strict=True, reason="predicted 41.6 / 43.4 GiB vs published 82.5 / 72.7 GiB: the model counts "
                   "live tensors; the published figure is what the job reserved (allocator, float8 copies, "
                   "buffers), and falls from 1F1B to Interleaved where the model's rises")
@pytest.mark.parametrize("name,v", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_405b_memory_within_10_percent(fitted, name, v):
    assert _405b(fitted, name, v).memory_bytes / GiB == pytest.approx(PUBLISHED_405B[name][1], rel=0.10)


@pytest.mark.xfail(strict=True, reason="70B under the 405B-fitted factor: predicted 628 tokens/s/GPU and 7.9 GiB "
                   "vs published 829 and 71.9")
def test_70b_under_the_same_factor(fitted):
    cluster = fitted.with_(gpus=256)
    got = evaluate(LLAMA_70B, cluster, Layout(pp=1, dp=32, tp=8, v=1, m=16, mb=1, ac=True), "1F1B", 8192)
    assert got.tokens_per_s_per_gpu == pytest.approx(PUBLISHED_70B[0], rel=0.10)
    assert got.memory_bytes / GiB == pytest.approx(PUBLISHED_70B[1], rel=0.10)


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


def test_readme_figures(fitted):
    """The figures README's "Planning a cluster job on paper" table prints (predicted, under the
    factor fitted on Table 5's 1F1B row): a change to the cost model must update both."""
    one, inter = _405b(fitted, "1F1B", 1), _405b(fitted, "Interleaved1F1B", 2)
    got70 = evaluate(LLAMA_70B, fitted.with_(gpus=256), Layout(pp=1, dp=32, tp=8, v=1, m=16, mb=1, ac=True), "1F1B",
                     8192)
    assert round(fitted.efficiency, 2) == 0.48
    assert round(inter.tokens_per_s_per_gpu) == 111 and round(one.memory_bytes / GiB, 1) == 41.6
    assert round(inter.memory_bytes / GiB, 1) == 43.4
    assert round(got70.tokens_per_s_per_gpu) == 628 and round(got70.memory_bytes / GiB, 1) == 7.9
