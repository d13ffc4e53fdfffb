"""A value that crosses a cut between ranks reaches the next stage in the layout the unsplit
model has there (a channels-last activation stays channels-last), so the receiving stage's
kernels are the unsplit model's: on CPUs without native bf16 (AVX2), a depthwise convolution
on a row-major copy rounds differently and ConvNeXt's bf16 gradients differed by 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .layout_bodies import channels_last_step, reference


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_channels_last_activation_crosses_ranks_channels_last():
    ref = reference()
    results = run_ranks(channels_last_step, 2, timeout=100)
    assert results[1]["strides"] == ref["strides"], "rank 1's dw read another memory layout than the unsplit model's"
    assert results[0]["dim_order"] == (0, 2, 3, 1)
    grads = {n: g for res in results for n, g in res["grads"].items()}
    assert sorted(grads) == sorted(ref["grads"])
    for rank, res in enumerate(results):
        assert abs(res["loss"] - ref["loss"]) < 1e-5, f"rank {rank}: loss {res['loss']} vs {ref['loss']}"
    for name, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
