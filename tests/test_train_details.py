"""Smaller parts of `pippy-split train`: `--plan` on 2 ranks without numpy (ps.plan agrees over the
numpy-free broadcast), plain log lines not wrapped at 80 columns, and AdamW's weight decay as an option."""

from __future__ import annotations

import pytest
import torch

from pippy_split.training.config import TrainConfig, parse_train_args

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


def test_plain_log_lines_are_not_wrapped_at_80_columns(monkeypatch):
    import io

    from pippy_split.training.loop import job_console

    monkeypatch.delenv("COLUMNS", raising=False)  # a file or a pipe: rich assumes 80 columns
    out = io.StringIO()
    line = "pippy-split train: Qwen2ForCausalLM, 4 stages on 2 ranks (gloo), schedule ZBVZeroBubble, " \
           "4 microbatches, 53,792 params, simulated bubble 4.0%"
    console = job_console(out)
    console.print(line)
    console.print(f"step 120000  {'x' * 90}", highlight=False)
    assert out.getvalue().splitlines() == [line, f"step 120000  {'x' * 90}"]


def test_weight_decay_is_an_option_with_its_help():
    from pippy_split.train import train_main as main
    from pippy_split.training.config import build_train_parser
    from pippy_split.training.optim import make_optimizer

    assert TrainConfig().weight_decay == 0.01 and parse_train_args(["--weight-decay", "0"]).weight_decay == 0.0
    p = torch.nn.Parameter(torch.ones(2))
    assert make_optimizer(TrainConfig(weight_decay=0.2), [p]).param_groups[0]["weight_decay"] == 0.2
    assert "AdamW's decoupled weight decay" in " ".join(build_train_parser().format_help().split())
    assert main(["--weight-decay", "-1"]) == 2
