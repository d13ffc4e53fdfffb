"""ps.parallelize's argument checks (no process group needed: they run before any torch call)."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps


def _stage() -> ps.PipelineStage:
    return ps.PipelineStage(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), 0, 1)


def test_fsdp_patterns_without_a_mesh_are_refused():
    with pytest.raises(ValueError, match=r"fsdp=\['0'\] needs dp_mesh="):
        ps.parallelize(_stage(), fsdp=["0"])


def test_tp_plan_without_a_mesh_is_refused():
    with pytest.raises(ValueError, match="tp_plan with 1 entries needs tp_mesh="):
        ps.parallelize(_stage(), tp_plan={"0": object()})


def test_a_pattern_matching_no_module_names_the_closest():
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*' matches no module .* closest module names: \['0', '1'\]"):
        ps.parallelize(_stage(), dp_mesh=object(), fsdp=["layers.*"])


def test_something_other_than_stages_is_refused():
    with pytest.raises(ValueError, match="takes a schedule, a PipelineStage or a list of them"):
        ps.parallelize([torch.nn.Linear(2, 2)])
