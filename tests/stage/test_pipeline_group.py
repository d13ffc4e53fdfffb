"""``PipelineGroup``: the one value the schedule hands its collectives. Pure tier (no
process group); its group-local rank over a mesh dimension is checked in
``tests/dist/test_nd_parallel.py``.

Run: python -m pytest tests/stage/test_pipeline_group.py -q -p no:cacheprovider
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pippy_split.stage.errors import PipelineError
from pippy_split.stage.groups import PipelineGroup


def test_without_a_process_group_it_is_rank_0_of_1_on_the_given_device():
    pg = PipelineGroup.of(None, "cpu")
    assert (pg.group, pg.rank, pg.world, pg.device) == (None, 0, 1, torch.device("cpu"))


def test_it_is_frozen_and_keyword_only():
    pg = PipelineGroup.of(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pg.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        PipelineGroup(None, 0, 1, torch.device("cpu"))  # type: ignore[misc]


def test_a_launched_rank_without_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(PipelineError, match=r"WORLD_SIZE=4 ranks .*init_process_group\(\)"):
        PipelineGroup.of(None)
