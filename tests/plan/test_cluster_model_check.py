"""The cost model's terms that the check against this machine needs (a fixed cost per
message, the training dtype's element size, a plain MLP), and a smoke run of
``benchmarks.cluster_model_check`` on a tiny case. No timing is asserted: the predicted
vs measured figures live in ``benchmarks/results/cluster_model_check.md``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pippy_split as ps
from pippy_split.plan.cluster import ClusterLayout, ModelShape, Runtime, price_layout
from pippy_split.plan.cluster.block import block_matmuls, block_times
from pippy_split.plan.cluster.costs import layout_costs
from pippy_split.plan.cluster.memory import BF16
from pippy_split.schedule import simulate
from pippy_split.schedule.orders import get_order_spec

ROOT = Path(__file__).resolve().parents[2]
GPT = ModelShape(layers=4, hidden=256, intermediate=1024, heads=4, kv_heads=4, vocab=64, gated=False)
LAY = ClusterLayout(pp=2, dp=1, tp=1, v=1, m=4, mb=2, ac=False)


def test_a_plain_mlp_has_two_matrices_a_gated_one_three():
    h, i = 256, 1024
    gated = ModelShape(layers=1, hidden=h, intermediate=i, heads=4, kv_heads=4, vocab=64)
    assert gated.layer_params - GPT.layer_params == h * i


def test_p2p_latency_adds_once_per_message_and_dtype_scales_the_bytes():
    base = ps.Cluster(gpus=2, gpus_per_node=2, intra_node_bw=1e9)
    plain = layout_costs(GPT, base, LAY, 128)
    slow = layout_costs(GPT, base.with_(p2p_latency=1e-3), LAY, 128)
    assert slow.p2p_s == pytest.approx(plain.p2p_s + 1e-3)
    fp32 = layout_costs(GPT, base, LAY, 128, dtype_bytes=4)
    assert fp32.p2p_s == pytest.approx(2 * plain.p2p_s)  # t h elements of 4 bytes, not 2
    assert layout_costs(GPT, base, LAY, 128, dtype_bytes=BF16) == plain


def test_block_forward_is_what_a_stage_is_made_of():
    """At a flat efficiency (a machine measured at the model's shapes) a block is its matmuls'
    and causal attention's FLOPs at that rate."""
    cluster = ps.Cluster(gpus=2, gpus_per_node=2, flops=1e11, efficiency=1.0)
    costs = layout_costs(GPT, cluster, LAY, 128, dtype_bytes=4)
    block = block_times(GPT, cluster, LAY, 128, Runtime(), dtype_bytes=4).forward
    assert costs.forward[0] == pytest.approx(2 * block)  # 2 blocks, no head on the first stage
    matmul_params = sum(k * n for _, k, n in block_matmuls(GPT, 1, 1))
    assert matmul_params == GPT.layer_params - 2 * GPT.hidden  # every weight but the two norms'
    assert block == pytest.approx(2 * (matmul_params + 128 * 256) * 256 / 1e11)


def test_a_negative_latency_is_refused():
    with pytest.raises(ValueError, match="p2p_latency"):
        ps.Cluster(gpus=2, p2p_latency=-1.0)


@pytest.mark.timeout(300)
def test_cluster_model_check_smoke(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cluster_model_check", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    row, = res["rows"]
    assert row["case"]["world"] == 2 and len(row["per_step"]) == row["measured_s"]["n"] == 1
    assert row["predicted"]["step_s"] > 0 and row["measured_s"]["median"] > 0
    assert {"flops", "mem_bw", "p2p_latency_s", "p2p_bw", "block_fwd_s", "block_bwd_s"} <= set(row["constants"])
    assert "predicted / measured" in out.with_suffix(".md").read_text()


def test_action_overhead_is_each_actions_host_time():
    """With ops free, a step is the order's makespan when every F and B takes the overhead."""
    free = ps.Cluster(gpus=2, gpus_per_node=2, flops=1e30, hbm_bw=1e30, intra_node_bw=1e30, action_overhead=2e-3)
    step = price_layout(GPT, free, LAY, "1F1B", 128, dtype_bytes=4).step_s
    unit = simulate(get_order_spec("1F1B").compute_order(2, 4), {"F": 1.0, "B": 1.0}).makespan
    assert step == pytest.approx(2e-3 * unit, rel=1e-6)
    assert price_layout(GPT, free.with_(action_overhead=0.0), LAY, "1F1B", 128).step_s < 1e-6
