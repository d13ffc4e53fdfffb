"""Smoke test of the packing benchmark: packed against padded microbatches runs and reports every figure.

Runs ``python -m benchmarks.packing --smoke`` in a subprocess (tiny Llama, 2 gloo ranks,
1F1B and ZBVZeroBubble, one warm-up and one timed step per layout) and checks the JSON it
writes. No timing is asserted (speed claims live in the benchmark's results, never in
tests); what is checked holds on any machine: both layouts run the same real tokens and
reach the same loss, the padded layout's padding fraction is what its shapes say, and the
packed layout holds fewer activation bytes on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_packing_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "packing.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.packing", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "packed/padded tokens/s" in proc.stdout and "padding fraction" in proc.stdout
    assert out.with_suffix(".md").read_text().startswith("`python -m benchmarks.packing --smoke`")

    res = json.loads(out.read_text())
    meta = res["meta"]
    assert {"command", "commit", "size", "reps", "warmup", "load_avg_before", "load_avg_after"} <= set(meta)
    size = meta["size"]
    assert [row["schedule"] for row in res["rows"]] == ["1F1B", "ZBVZeroBubble"]
    for row in res["rows"]:
        for key in ("padded_tokens_per_s", "packed_tokens_per_s", "tokens_per_s_packed_over_padded",
                    "cpu_packed_over_padded", "padding_fraction", "ideal_gain", "packed_row_lengths"):
            assert {"median", "min", "max", "n"} <= set(row[key]), key
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"], key
        assert row["tokens_per_s_packed_over_padded"]["median"] > 0
        slots = size["n_mb"] * size["rows"] * size["max_len"]
        assert row["padded_slots"] == slots
        real = row["real_tokens"]["median"]
        assert 2 * size["n_mb"] * size["rows"] <= real < slots
        assert row["padding_fraction"]["median"] == pytest.approx(1 - real / slots)
        assert row["packed_row_lengths"]["max"] <= size["rows"] * size["max_len"]
        loss = row["last_loss"]
        assert loss["packed"] == pytest.approx(loss["padded"], rel=1e-4)  # same documents, same model
        assert [x["rank"] for x in row["activations"]] == [0, 1]
        for x in row["activations"]:
            assert x["padded_bytes"]["median"] > 0 and x["packed_bytes"]["median"] > 0
            assert x["packed_over_padded"]["median"] < 1  # no padding to hold activations for
