"""Smaller parts of `pippy-split train`: `--plan` on 2 ranks without numpy (ps.plan agrees over the
numpy-free broadcast), plain log lines that fit 80 columns, and AdamW's weight decay as an option."""

from __future__ import annotations

import pytest
import torch

from .test_no_numpy import _numpy_is_blocked, _run


def plan_body(rank: int, world: int) -> str:
    """ps.plan of a tiny MLP on every rank (under run_ranks, numpy blocked): every rank takes rank 0's plan."""
    import pippy_split as ps

    assert _numpy_is_blocked()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    plan = ps.plan(model, (torch.randn(2, 8),), num_ranks=2, memory_budget="1GB", global_batch=8,
                   loss_fn=lambda o, t: ((o - t) ** 2).mean(), example_target=torch.zeros(2, 8))
    return str(plan.best.split.cut_fqns)


_PLAN_DRIVER = """
from pippy_split.testing import run_ranks
from tests.test_train_details import plan_body
print(repr(run_ranks(plan_body, 2, timeout=150)))
"""


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_plan_on_two_ranks_needs_no_numpy(tmp_path):
    r = _run(tmp_path, "-c", _PLAN_DRIVER, timeout=200)
    cuts = eval(r.stdout.strip().splitlines()[-1])
    assert len(cuts) == 2 and cuts[0] == cuts[1], r.stdout
