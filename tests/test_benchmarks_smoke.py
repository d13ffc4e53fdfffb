"""Smoke test of the side-by-side benchmarks: the traffic item runs and ours moves the minimum.

Runs ``python -m benchmarks.compare --smoke --only traffic`` in a subprocess (the fan-out
skip model, 3 stages on 3 gloo ranks, 1F1B) and checks the JSON it writes. The
analytical minimum is computed here from ``pipe.edges`` on its own, not with the
benchmark's helper: each edge between stages on different ranks once per microbatch
forward, once backward when its spec carries a gradient, nothing between stages on the
same rank. No timing is asserted (speed claims live in the benchmarks, never in tests).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo

ROOT = Path(__file__).resolve().parents[1]
N_MB, WORLD = 4, 3  # what benchmarks.traffic uses for fan_out_skip


def _minimum(pipe: ps.Pipe, placement: dict[int, int], n_mb: int, world: int) -> list[dict[str, int]]:
    out = [dict(sent_bytes=0, sent_msgs=0, recv_bytes=0, recv_msgs=0) for _ in range(world)]
    for e in pipe.edges:
        src_rank = placement[0 if e.src_stage == ps.MODEL_INPUT else e.src_stage]
        dst_rank = placement[e.dst_stage]
        if src_rank == dst_rank:
            continue
        nbytes = math.prod(int(d) for d in e.spec.shape) * torch.empty((), dtype=e.spec.dtype).element_size()
        directions = [(src_rank, dst_rank)]
        if e.spec.carries_grad and e.src_stage != ps.MODEL_INPUT:
            directions.append((dst_rank, src_rank))
        for a, b in directions:
            out[a]["sent_bytes"] += n_mb * nbytes
            out[a]["sent_msgs"] += n_mb
            out[b]["recv_bytes"] += n_mb * nbytes
            out[b]["recv_msgs"] += n_mb
    last = placement[pipe.num_stages - 1]  # the step's fp32 loss, to every other rank (sched.loss everywhere)
    for r in range(world):
        if r != last:
            out[last]["sent_bytes"] += 4
            out[last]["sent_msgs"] += 1
            out[r]["recv_bytes"] += 4
            out[r]["recv_msgs"] += 1
    return out


@pytest.mark.timeout(120)
def test_traffic_smoke(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--smoke", "--only", "traffic",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {"meta", "traffic"} <= set(res)
    assert {"command", "mode", "reps", "load_avg_before", "load_avg_after"} <= set(res["meta"])
    rows = {r["case"]["name"]: r for r in res["traffic"]["rows"]}
    row = rows["fan_out_skip"]
    for key in ("case", "edges", "expected", "ours", "ours_equals_minimum", "peer"):
        assert key in row
    # The peer cannot run a skip that fans out; the table says why instead of a number.
    assert row["peer"] is None and row["peer_error"]

    entry = zoo.get("fan_out_skip")
    (args, kwargs), = ps.split_args_kwargs(entry.args, entry.kwargs, N_MB)[:1]
    pipe = ps.pipeline(entry.model, entry.split_spec, args, kwargs)
    placement = ps.stage_to_rank(pipe.num_stages, WORLD, ps.get_schedule_class("1F1B").placement)
    expected = _minimum(pipe, placement, N_MB, WORLD)
    assert any(e.is_skip for e in pipe.edges)  # the model really has a skip crossing a stage
    assert len(row["ours"]) == WORLD
    for rank in range(WORLD):
        for key, value in expected[rank].items():
            counted = row["ours"][rank][key]
            assert counted["min"] == counted["max"] == value, (rank, key, counted, value)
    assert row["ours_equals_minimum"] is True


@pytest.mark.timeout(120)
def test_nd_parallel_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.nd_parallel --smoke``: PP2 x per-block FSDP2 on 4 gloo ranks, ours
    and the peer, one timed step each. Each rank keeps half its stage's parameters (dp=2) and
    no all-gather is larger than one block (counted here from the zoo's model)."""
    out = tmp_path / "nd_parallel.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.nd_parallel", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".md").read_text().startswith("`python -m benchmarks.nd_parallel --smoke`")
    res = json.loads(out.read_text())
    assert {"command", "load_avg_before", "load_avg_after", "size"} <= set(res["meta"])
    (row,) = res["rows"]
    assert row["config"] == "fsdp_block" and len(row["ranks"]) == 4
    s = res["meta"]["size"]
    model = zoo.get("tiny_llama", d_model=s["d"], n_layer=s["n_layer"], n_head=s["n_head"]).model
    block = sum(p.numel() for p in model.layers[0].parameters())
    for r in row["ranks"]:
        for tool in ("ours", "peer"):
            x = r[tool]
            assert x["params"] * 2 == pytest.approx(x["stage_param_bytes_full"], rel=0.02), (r["rank"], tool, x)
            assert 0 < x["max_gather"] <= block, (r["rank"], tool, x["max_gather"], block)
            assert x["state"] == x["params"] + x["grads"] + x["opt"]
    assert row["ours_over_peer"]["n"] == 1


@pytest.mark.timeout(120)
def test_generate_startup_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.generate_startup --smoke`` on a 1-rank run of a small TinyGPT written here: one
    timed ``pippy-split generate``, whose phases (each a function of the library, none missing) add up to its
    wall time. No timing is asserted."""
    from pippy_split.training.finish import save_model_file
    from pippy_split.zoo.gpt import TinyGPT

    gpt = dict(vocab_size=13, d_model=16, n_layer=2, n_head=2, block_size=64)
    config = dict(schedule="GPipe", ranks=1, batch_size=8, microbatches=4, seq_len=16)
    save_model_file(str(tmp_path / "run"), TinyGPT(**gpt).state_dict(),
                    {"gpt_config": gpt, "chars": "\n+0123456789=", "config": config, "split": None})
    out = tmp_path / "startup.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.generate_startup", "--smoke", "--run-dir",
                           str(tmp_path / "run"), "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".md").read_text().startswith("`python -m benchmarks.generate_startup --smoke")
    res = json.loads(out.read_text())
    assert {"command", "load_avg_before", "load_avg_after", "turns"} <= set(res["meta"]) and res["missing"] == []
    phases = res["summary"]["this tree"]["timeline"]
    for name in ("launcher imports", "rank 0: run's Pipe rebuilt (trace)", "rank 0: sched.generate",
                 "rank 0: sched.generate / decode program (trace)", "rank 0: sched.generate / decode (the rest)"):
        assert phases[name] >= 0, name
    steps = sum(v for k, v in phases.items() if " / " not in k and k != "total")
    assert steps == pytest.approx(phases["total"], abs=1e-6)  # one rank: the phases tile the wall time
