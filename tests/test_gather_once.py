"""``fsdp_gather="once"``'s choice of modules and ``ps.parallelize``'s checks of it (no process
group: the checks run before any torch.distributed call). The distributed behaviour is in
tests/dist/test_gather_once.py."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split.stage.gather_once import choose_kept


def _stage() -> ps.PipelineStage:
    return ps.PipelineStage(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), 0, 1)


def test_the_smallest_modules_are_kept_first_ties_in_module_order():
    assert choose_kept([100, 10, 100, 50], 160) == [0, 1, 3]
    assert choose_kept([100, 10, 100, 50], 259) == [0, 1, 3]
    assert choose_kept([100, 10, 100, 50], 260) == [0, 1, 2, 3]
    assert choose_kept([30, 30, 30], 60) == [0, 1]


def test_no_budget_keeps_every_module_and_too_small_a_budget_keeps_none():
    assert choose_kept([100, 10], None) == [0, 1]
    assert choose_kept([100, 10], 9) == []
    assert choose_kept([100, 0], 0) == [1]  # a root without parameters of its own costs nothing


@pytest.mark.parametrize("budget", ["lots", -1, True, [1024], float("nan"), "12 parsecs"])
def test_a_budget_that_is_not_a_size_is_refused_saying_what_works(budget):
    with pytest.raises(ValueError, match=r"gather_budget= takes a number of bytes >= 0: an int, or a string such as "
                                         r"'512MiB' or '2GB'"):
        ps.parallelize(_stage(), dp_mesh=object(), fsdp=["0"], fsdp_gather="once", gather_budget=budget)


def test_an_unknown_gather_mode_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"fsdp_gather='twice'; it is 'per_microbatch' .* or 'once'"):
        ps.parallelize(_stage(), dp_mesh=object(), fsdp=["0"], fsdp_gather="twice")


def test_a_budget_without_once_or_once_without_a_mesh_is_refused():
    with pytest.raises(ValueError, match="gather_budget= applies to fsdp_gather='once'"):
        ps.parallelize(_stage(), dp_mesh=object(), fsdp=["0"], gather_budget="1GiB")
    with pytest.raises(ValueError, match="fsdp_gather='once' needs dp_mesh="):
        ps.parallelize(_stage(), fsdp_gather="once")


def test_once_with_a_tp_plan_is_refused_naming_what_works():
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ValueError, match=r"fsdp_gather='once' with tp_plan .* not tested exact yet; use "
                                         r"fsdp_gather='per_microbatch' \(the default\) with TP, or 'once' without"):
        ps.parallelize(_stage(), dp_mesh=object(), fsdp=["0"], fsdp_gather="once", tp_mesh=object(),
                       tp_plan={"0": ColwiseParallel()})


def test_an_int_reshard_after_forward_is_refused_with_once():
    with pytest.raises(ValueError, match="takes a bool there, not reshard_after_forward=2"):
        ps.parallelize(_stage(), dp_mesh=object(), fsdp=["0"], fsdp_gather="once", reshard_after_forward=2)
