"""The cluster planner against every published run of ``benchmarks.published_runs`` (sources
in ``benchmarks/published_runs.md``), under one set of constants: each row within 15% in
tokens/s/GPU and, where published, reserved memory; each row's ratio to its table's first row
within 10%. Rows the model does not meet are strict xfails whose reason gives the measured
error, so a change that closes one turns it into a failure to promote.

Also the issue-43 fixes one by one (each failed before): presets in PyTorch's units, ``only=``
refusing a batch its layout cannot form, loss-parallel bytes only under TP, matmul efficiency
rising with width, Float8 pricing its casts (a shared input cast once when compiled or under
TP), what op-level SAC keeps, FSDP2's peak without PP and its copy-out on the compute stream,
ring attention's per-round correction, attention's efficiency by the length one call sees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pippy_split as ps
from benchmarks.published_runs import LLAMA3_8B, RUNS, TITAN, errors, price, table_ratios, torch_ring_rows
from pippy_split.plan.cluster import ClusterLayout, Runtime
from pippy_split.plan.cluster import block as cluster_block
from pippy_split.plan.cluster.block import (
    RING_CORRECTION_BYTES,
    _float8_cast_bytes,
    block_matmuls,
    block_times,
    ring_correction_s,
)
from pippy_split.plan.cluster.costs import copy_out_s, data_parallel_exposed_s
from pippy_split.plan.cluster.kernels import attention_s, gemm_s, memory_s
from pippy_split.plan.cluster.memory import activation_bytes, head_bytes, loss_peak_bytes, unsharded_without_pp

GiB = 2**30
DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster_planning.md"
MISSES = {
    ("torchtitan H100 T2", "8B FSDP 1 CP 8 seq 262144"): "tokens/s/GPU predicted 635 vs 548 published (+16%): the four "
    "Table 2 rows hold the same 32,768 tokens a GPU; beside the model's non-attention part of a token, the published "
    "steps give a ring round of 172, 154, 212, 217 us a token at CP 1, 2, 4, 8 (flat to CP 2, 32% dearer from CP 4). "
    "Priced as torch's Dec-2024 ring runs (benchmarks.published_runs.torch_ring_extra_s: K/V repeated to all 32 heads "
    "and all-gathered, 3.8 GB a layer at CP 8, 10 ms on NVLink, hidden behind round 0's 36 ms; half-block rounds at "
    "f(t) f(t/2), +0.4%; fp32 dQ/dK/dV accumulators, 30 bytes an element a round against 20, 44 once a backward; "
    "dK/dV's last fp32 hop, 1.07 GB a layer, 3.0 ms exposed) this row is 629 (+14.8%), but CP 2 falls to 2,143 "
    "(0.844, out) and its ratio to 0.895 (out): 0.23 s a step at CP 2, 0.50 s at CP 8; nothing in that ring steps "
    "between CP 2 and CP 4, so CP 2 and CP 8 cannot both hold",
}
MEMORY_MISSES: dict[tuple[str, str], str] = {}
RATIO_MISSES = {
    ("torchtitan H100 T2", "8B FSDP 2 CP 4 seq 131072"): "predicted 0.328 of the CP 1 row vs 0.275 published (+19%; "
    "0.324, +18%, with the ring priced as torch's code runs it, test_torch_ring_as_run_trades_cp_2_for_cp_8): "
    "with a per-round cost the same at every cp, CP 2's ratio within 10% needs a round under 0.70 of the CP 1 step "
    "and CP 4's over 0.77; published, a round costs 32% more from CP 4 on than at CP 1-2, and nothing in torch's "
    "load-balanced, all-gather ring grows there (see the CP 8 row's reason)",
    ("torchtitan H100 T2", "8B FSDP 1 CP 8 seq 262144"): "predicted 0.173 of the CP 1 row vs 0.141 published (+23%; "
    "0.172, +22%, with the ring priced as torch's code runs it), as above",
    ("torchtitan A100 Llama 2", "70B selective op"): "predicted 0.187 of the 13B no-AC row vs 0.164 published (+14%): "
    "the row itself is within 15% (+12%); published, this mb=1 op-SAC run (mb=2 ran out of memory, the source's "
    "footnote; the model says 104 GiB) is as fast as the same model's full-AC run at mb=2 (355 vs 353). At mb=1 "
    "FSDP moves the same 8 bytes a parameter a step for half the tokens: with 56-64 GB/s a node across nodes "
    "(400-500 Gb/s, e.g. 4 x 100 Gb/s EFA) instead of the preset's 8 x 200 Gb/s, this row is network-bound at "
    "0.93-1.06 of its figure and every other A100 row moves under 1%; the source does not state its network, so "
    "no preset is changed on one row's account",
}


def _marks(key: tuple[str, str], misses: dict[tuple[str, str], str]) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=misses[key])] if key in misses else []


@pytest.mark.parametrize("run", [pytest.param(r, id=f"{r.table}: {r.name}", marks=_marks((r.table, r.name), MISSES))
                                 for r in RUNS])
def test_row_throughput_within_15_percent(run):
    tps, _ = errors(run)
    assert tps == pytest.approx(1.0, rel=0.15), f"predicted/published {tps:.2f}"


@pytest.mark.parametrize("run", [pytest.param(r, id=f"{r.table}: {r.name}", marks=_marks((r.table, r.name), MEMORY_MISSES))
                                 for r in RUNS if r.memory_gib])
def test_row_reserved_memory_within_15_percent(run):
    _, mem = errors(run)
    assert mem == pytest.approx(1.0, rel=0.15), f"predicted/published {mem:.2f}"


@pytest.mark.parametrize("row", [pytest.param(r, id=f"{r[0]}: {r[1]}", marks=_marks((r[0], r[1]), RATIO_MISSES))
                                 for r in table_ratios()])
def test_ratio_within_a_table_within_10_percent(row):
    _, _, predicted, published = row
    assert predicted / published == pytest.approx(1.0, rel=0.10)


def test_at_least_six_rows_from_two_other_sources_pass():
    """The issue's bar: six or more published runs beyond torchtitan's Tables 4-6, from two or
    more sources, within 15% (memory too, where published)."""
    other = [r for r in RUNS if not r.table.startswith("torchtitan H100") and (r.table, r.name) not in MISSES]
    sources = {r.table.split(" ")[0] + (" A100" if "A100" in r.table else "") for r in other}
    assert len(other) >= 6 and {"NeMo", "torchtitan A100"} <= sources


def test_presets_are_in_the_units_pytorch_reports():
    """An 80 GB H100 exposes 79.11 GiB to PyTorch (before: 80e9 bytes, 74.5 GiB, 7% short)."""
    assert ps.Cluster.preset("h100-sxm").hbm_bytes == pytest.approx(79.11 * GiB)
    assert ps.Cluster.preset("a100-80gb").hbm_bytes == pytest.approx(79.25 * GiB)


def test_only_refuses_a_layout_that_cannot_form_the_batch():
    """Before, ``only=`` priced a layout whatever batch it formed, silently."""
    shape = ps.ModelShape(layers=4, hidden=512, intermediate=2048, heads=8, kv_heads=8, vocab=1000)
    lay = ClusterLayout(pp=2, dp=4, tp=1, v=1, m=4, mb=1, ac="full")  # 4 x 4 x 1 = 16 sequences
    cluster = ps.Cluster.preset("h100x8")
    assert ps.plan_cluster(shape, cluster, global_batch_tokens=16 * 2048, seq_len=2048, only=[(lay, "1F1B")]).best.fits
    with pytest.raises(ValueError, match=r"forms a batch of 16 sequences, not the global batch of 32: choose m x mb = 8"):
        ps.plan_cluster(shape, cluster, global_batch_tokens=32 * 2048, seq_len=2048, only=[(lay, "1F1B")])
    with pytest.raises(ValueError, match=r"uses 8 GPUs, but the cluster has 16"):
        ps.plan_cluster(shape, ps.Cluster.preset("h100x16"), global_batch_tokens=16 * 2048, seq_len=2048,
                        only=[(lay, "1F1B")])


def test_loss_parallel_bytes_only_under_tp():
    """torchtitan enables loss parallel only with TP; at TP 1 its loss holds the log-softmax and
    its gradient (8 bytes a logit besides the fp32 logits), not loss parallel's 12."""
    tokens = 2 * 8192
    for tp, own in ((1, TITAN.loss_bytes), (8, TITAN.loss_parallel_bytes)):
        lay = ClusterLayout(pp=1, dp=8, tp=tp, v=1, m=1, mb=2, ac="full")
        logits, _ = head_bytes(LLAMA3_8B, tokens, tp)
        assert loss_peak_bytes(LLAMA3_8B, tokens, lay, TITAN) == pytest.approx(logits * (TITAN.logits_bytes + own))
    assert TITAN.loss_bytes < TITAN.loss_parallel_bytes


def test_matmul_efficiency_rises_with_width():
    """Per-GPU matmul widths of a 39B and a 1T model under TP 8 (hidden 8192 and 25600): the
    wider one runs faster per FLOP, as published runs do (a flat efficiency said equal)."""
    c = ps.Cluster.preset("a100-80gb")
    narrow = gemm_s(8192, 8192 / 8, 8192, c) / (8192 / 8)
    wide = gemm_s(8192, 25600 / 8, 8192, c) / (25600 / 8)
    assert wide < narrow * 0.97


def test_float8_prices_its_casts_and_leaves_attention_in_bf16():
    """Float8 speeds the projections' matmuls only: its casts cost HBM traffic, attention does
    not change, so fp8 over bf16 stays well under the 2x of the peaks (published 1.28 on 8B)."""
    c = ps.Cluster.preset("h100-96gb", gpus=8)
    lay = ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=2, ac="selective-op")
    bf16 = block_times(LLAMA3_8B, c, lay, 8192, TITAN.with_(fused_elementwise=True))
    fp8 = block_times(LLAMA3_8B, c, lay, 8192, TITAN.with_(fused_elementwise=True, float8_linears=True))
    no_cast = block_times(LLAMA3_8B, c, lay, 8192, TITAN.with_(fused_elementwise=True, float8_linears=True,
                                                               float8_cast_bytes=0.0))
    assert no_cast.forward < fp8.forward < bf16.forward
    assert 1.2 < (bf16.forward + bf16.backward) / (fp8.forward + fp8.backward) < 1.6


def test_context_parallel_selective_ac_and_plain_dp_are_layout_terms():
    """CP shards each sequence (a rank's tokens fall by cp), selective AC keeps more than full AC
    and less than none, plain DP replicates the parameters FSDP shards."""
    c = ps.Cluster.preset("h100-96gb", gpus=8)
    full = price(next(r for r in RUNS if r.name == "8B FSDP 8 CP 1 seq 32768"))
    cp2 = price(next(r for r in RUNS if r.name == "8B FSDP 4 CP 2 seq 65536"))
    assert cp2.layout.cp == 2 and cp2.tokens_per_s_per_gpu < full.tokens_per_s_per_gpu
    held = {}
    for ac in ("full", "selective-op", "none"):
        lay = ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=1, ac=ac)
        held[ac] = ps.plan_cluster(LLAMA3_8B, c, global_batch_tokens=8 * 4096, seq_len=4096,
                                   only=[(lay, "1F1B")]).best.live_bytes
    assert held["full"] < held["selective-op"] < held["none"]
    lay = ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=1, ac="full", fsdp=False)
    ddp = ps.plan_cluster(LLAMA3_8B, c, global_batch_tokens=8 * 4096, seq_len=4096, only=[(lay, "1F1B")],
                          runtime=Runtime()).best
    assert "parameters (bf16, replicated)" in ddp.memory and ddp.live_bytes > held["full"]


def test_docs_table_is_what_the_planner_predicts():
    """docs/cluster_planning.md's predicted-over-published table prints these rows' figures:
    a change to the cost model must update both."""
    text = DOC.read_text()
    table = text[text.index("<!-- published-table -->"):text.index("<!-- /published-table -->")]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(RUNS)
    for cells, run in zip(rows, RUNS):
        tps, mem = errors(run)
        assert [c.strip() for c in cells[:2]] == [run.table, run.name]
        assert float(cells[3]) == round(tps, 2), run.name
        assert (cells[5].strip() == "") == (mem is None) and (mem is None or float(cells[5]) == round(mem, 2))
    summary = re.search(r"(\d+) of (\d+) rows are within 15%", text)
    assert summary and int(summary.group(2)) == len(RUNS) and int(summary.group(1)) == len(RUNS) - len(MISSES)
    memory = re.search(r"(\d+) of the (\d+) published memory figures within 15%", text)
    published = sum(1 for r in RUNS if r.memory_gib)
    assert memory and int(memory.group(2)) == published and int(memory.group(1)) == published - len(MEMORY_MISSES)
    ratios = {(table, name): pred for table, name, pred, _ in table_ratios()}
    summary = re.search(r"(\d+) of (\d+) ratios within a table are within 10%", text)
    assert summary and int(summary.group(2)) == len(ratios) and int(summary.group(1)) == len(ratios) - len(RATIO_MISSES)
    t1 = "torchtitan H100 T1"
    fp8 = ratios[t1, "8B FSDP + compile + Float8"] / ratios[t1, "8B FSDP + compile"]
    assert (f"1F1B\n{ratios['torchtitan H100 T5', '405B Interleaved1F1B']:.3f} against 1.280" in text
            and f"gain {ratios['torchtitan H100 T4', '70B 2D + AsyncTP']:.3f} against 1.057" in text
            and f"compile {fp8:.3f} against\n1.280" in text)


def test_launch_refuses_a_layout_pippy_split_train_cannot_run():
    """CP, plain DP and selective AC are priced for other runtimes; ``launch()`` says so by name
    instead of printing a command that would run something else."""
    cp2 = price(next(r for r in RUNS if r.name == "8B FSDP 4 CP 2 seq 65536"))
    with pytest.raises(ValueError, match=r"cannot run this layout \(context parallelism cp=2\)"):
        cp2.launch()
    sac = price(next(r for r in RUNS if r.name == "8B FSDP + compile"))
    with pytest.raises(ValueError, match=r"activation checkpointing 'selective-op'"):
        sac.launch()
    nemo = price(next(r for r in RUNS if r.name == "LLAMA2-7B"))
    with pytest.raises(ValueError, match=r"data parallelism without FSDP"):
        nemo.launch()


def test_op_sac_keeps_the_block_input_four_matmul_outputs_and_attention():
    """torchtitan's op SAC saves the block's input, q, v, gate, down and attention's output,
    ``t (4 h + kv + I)`` a block; the residual sum between attention and MLP is recomputed
    (before: ``5 h``, 4 GiB too much on Table 1's 8B)."""
    t, h, kv, i = 16384, LLAMA3_8B.hidden, 1024, LLAMA3_8B.intermediate
    assert activation_bytes(LLAMA3_8B, t, 1, "selective-op") == t * (4 * h + kv + i) * 2


def test_fsdp_without_pp_peaks_at_the_loss_with_no_unsharded_gradient():
    """At the loss only the root group and the last block are unsharded and no gradient exists
    yet; a block's backward holds two blocks, their gradients and the output projection's."""
    lay = ClusterLayout(pp=1, dp=8, tp=1, v=1, m=1, mb=2, ac="selective-op")
    root, block = 2 * LLAMA3_8B.vocab * LLAMA3_8B.hidden, LLAMA3_8B.layer_params
    assert unsharded_without_pp(LLAMA3_8B, lay, loss_bytes=25e9, recompute_bytes=3e9) == ((root + block) * 2, 0.0, 25e9)
    params, grads, work = unsharded_without_pp(LLAMA3_8B, lay, loss_bytes=0.0, recompute_bytes=3e9)
    assert (params, work) == ((root + 2 * block) * 2, 3e9) and grads == (root / 2 + 2 * block) * 2


def test_fsdp_copy_out_is_priced_on_the_compute_stream():
    """FSDP2 splits each gathered buffer into the unsharded parameters on the compute stream:
    4 bytes a parameter per gather, not hidden behind compute (none at a flat efficiency)."""
    c = ps.Cluster.preset("a100-80gb", gpus=64)
    lay = ClusterLayout(pp=1, dp=64, tp=1, v=1, m=1, mb=1, ac="selective-op")
    assert copy_out_s(LLAMA3_8B, c, lay, 64) == pytest.approx(4 * LLAMA3_8B.layer_params * 64 / (c.hbm_bw * 0.8))
    exposed = data_parallel_exposed_s(LLAMA3_8B, c, lay, 32, compute_s=100.0, one_backward_s=1.0, runtime=TITAN)
    assert exposed > copy_out_s(LLAMA3_8B, c, lay, 64) > 0 == copy_out_s(LLAMA3_8B, c.with_(efficiency=0.5), lay, 64)


def test_float8_casts_a_shared_input_once_when_compiled_or_under_tp():
    """q, k, v share an input, gate and up another: eager, each Float8 linear casts its own;
    compiled, one cast each; under TP, one cast on the sequence shard before the fp8 gather."""
    mms = block_matmuls(LLAMA3_8B, 16384, 1)
    eager, _ = _float8_cast_bytes(mms, TITAN.with_(float8_linears=True, float8_cast_bytes=3.0))
    fused, _ = _float8_cast_bytes(mms, TITAN.with_(float8_linears=True, fused_elementwise=True))
    h = LLAMA3_8B.hidden
    assert eager - fused == pytest.approx(3.0 * 16384 * 3 * h)  # k's, v's and up's casts of a shared input
    tp8, _ = _float8_cast_bytes(block_matmuls(LLAMA3_8B, 16384, 8), TITAN.with_(float8_linears=True), tp=8)
    untp, _ = _float8_cast_bytes(block_matmuls(LLAMA3_8B, 16384, 8), TITAN.with_(float8_linears=True), tp=1)
    assert tp8 < untp


def test_ring_attention_prices_its_per_round_correction(monkeypatch):
    """Each ring round after the first folds its partial output into the running one (a bf16
    read and an fp32 read-modify-write per output element): ``cp - 1`` rounds of ``t h / tp``
    elements, none without CP or at a flat measured efficiency. Per round it is a fixed share
    of the bytes and a falling share of the FLOPs as ``t`` grows."""
    c = ps.Cluster.preset("h100-sxm", gpus=8)
    h = LLAMA3_8B.hidden
    for cp in (1, 2, 4, 8):
        lay = ClusterLayout(pp=1, dp=8 // cp, tp=1, v=1, m=1, mb=1, ac="full", cp=cp)
        assert ring_correction_s(LLAMA3_8B, c, lay, 4096) == pytest.approx(
            memory_s(RING_CORRECTION_BYTES * 4096 * h * (cp - 1), c))
        assert ring_correction_s(LLAMA3_8B, c.with_(efficiency=0.5), lay, 4096) == 0.0
    lay = ClusterLayout(pp=1, dp=4, tp=1, v=1, m=1, mb=1, ac="full", cp=2)
    share = {t: ring_correction_s(LLAMA3_8B, c, lay, t) / attention_s(t, 2 * t, h, c) for t in (4096, 32768)}
    assert 7 < share[4096] / share[32768] <= 8  # bytes as t, FLOPs as t^2 (a short round also runs slower)
    with_it, one = block_times(LLAMA3_8B, c, lay, 8192, TITAN), ring_correction_s(LLAMA3_8B, c, lay, 4096)
    monkeypatch.setattr(cluster_block, "RING_CORRECTION_BYTES", 0.0)
    without = block_times(LLAMA3_8B, c, lay, 8192, TITAN)
    assert one > 0 == ring_correction_s(LLAMA3_8B, c, lay, 4096)
    assert with_it.forward - without.forward == pytest.approx(one)
    assert with_it.backward - without.backward == pytest.approx(2 * one)


def test_attention_efficiency_rises_with_the_length_one_call_sees():
    """Flash attention at a short sequence (or a ring round's ``s / cp`` shard) runs below its
    long-sequence rate, by the matmuls' tile rule over its two sequence dimensions; the head
    dimension and a flat measured efficiency leave it alone."""
    c = ps.Cluster.preset("h100-sxm", gpus=8)
    per_flop = {s: attention_s(s, s, 4096, c) / (s * s) for s in (2048, 8192, 32768)}
    assert per_flop[2048] > per_flop[8192] > per_flop[32768]
    assert per_flop[2048] / per_flop[32768] == pytest.approx(((32768 / (32768 + 128)) / (2048 / (2048 + 128))) ** 2)
    f = lambda d: d / (d + 128)  # noqa: E731
    shard = attention_s(32768, 65536, 4096, c, block_len=65536 / 8)  # a CP 8 rank's shard of a 64k sequence
    assert shard / attention_s(32768, 65536, 4096, c) == pytest.approx((f(65536) / f(8192)) ** 2)
    flat = c.with_(efficiency=0.5)
    assert attention_s(2048, 2048, 4096, flat) / 2048**2 == pytest.approx(attention_s(32768, 32768, 4096, flat) / 32768**2)


def test_torch_ring_as_run_trades_cp_2_for_cp_8():
    """Table 2's ring priced as torch's Dec-2024 code runs it (all-gathered K/V repeated to every
    head, half-block rounds, fp32 gradient accumulators, dK/dV's last hop exposed:
    ``benchmarks.published_runs.torch_ring_extra_s``) brings the CP 8 row within 15% only by
    taking the CP 2 row and its ratio out of their bars: why the Table 2 misses stand."""
    rows = {name: (pred, pub) for name, pred, pub in torch_ring_rows()}
    cp1 = next(r for r in RUNS if r.name == "8B FSDP 8 CP 1 seq 32768")
    base = price(cp1).tokens_per_s_per_gpu / cp1.tokens_per_s_per_gpu
    cp2, cp4, cp8 = (rows[f"8B FSDP {8 // cp} CP {cp} seq {32768 * cp}"] for cp in (2, 4, 8))
    assert cp8[0] / cp8[1] < 1.15 and cp2[0] / cp2[1] < 0.85 and cp2[0] / cp2[1] / base < 0.90
    assert cp4[0] / cp4[1] / base > 1.10 and cp8[0] / cp8[1] / base > 1.10
