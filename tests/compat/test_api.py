"""The drop-in's surface: torch.distributed.pipelining 2.13's public names and signatures,
read from the installed peer; and the library never imports the peer."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch.distributed.pipelining as peer
import torch.distributed.pipelining.microbatch as peer_microbatch
import torch.distributed.pipelining.schedules as peer_schedules
import torch.distributed.pipelining.stage as peer_stage

import pippy_split
from pippy_split import compat
from pippy_split.compat import microbatch, schedules, stage

MODULES = [(peer, compat), (peer_schedules, schedules), (peer_microbatch, microbatch), (peer_stage, stage)]


@pytest.mark.parametrize("theirs, ours", MODULES, ids=lambda m: m.__name__)
def test_every_public_name_of_the_peer_is_there(theirs, ours):
    missing = [n for n in theirs.__all__ if n not in ours.__all__ or not hasattr(ours, n)]
    assert not missing


def _params(fn, drop_var_keyword: bool = False) -> list[tuple]:
    params = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, p.default) for p in params if not (drop_var_keyword and p.kind is p.VAR_KEYWORD)]


CALLABLES = ["pipeline", "build_stage", "pipe_split"]
SCHEDULES = [n for n in peer_schedules.__all__ if n != "get_schedule_class"]


@pytest.mark.parametrize("name", CALLABLES)
def test_top_level_signatures(name):
    assert _params(getattr(compat, name)) == _params(getattr(peer, name))


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_signatures(name):
    theirs, ours = getattr(peer_schedules, name), getattr(schedules, name)
    assert _params(ours) == _params(theirs)
    for method in ("step", "eval"):
        assert _params(getattr(ours, method)) == _params(getattr(theirs, method)), method


def test_pipeline_stage_signature_is_the_peers_plus_our_options():
    ours = _params(compat.PipelineStage, drop_var_keyword=True)
    assert ours == _params(peer.PipelineStage)
    assert inspect.signature(compat.PipelineStage).parameters["options"].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("method", ["info", "build_stage", "get_stage_module"])
def test_pipe_method_signatures(method):
    assert _params(getattr(compat.Pipe, method)) == _params(getattr(peer.Pipe, method))


def test_microbatch_signatures():
    for name in ("split_args_kwargs_into_chunks", "merge_chunks"):
        assert _params(getattr(microbatch, name)) == _params(getattr(peer_microbatch, name)), name
    assert _params(microbatch.TensorChunkSpec) == _params(peer_microbatch.TensorChunkSpec)
    for name in ("from_tuple", "from_dict"):
        assert _params(getattr(microbatch.TensorChunkSpec, name)) == \
            _params(getattr(peer_microbatch.TensorChunkSpec, name)), name
    assert _params(schedules.get_schedule_class) == _params(peer_schedules.get_schedule_class)


def test_split_point_has_the_peers_members():
    assert list(compat.SplitPoint.__members__) == list(peer.SplitPoint.__members__)


def test_classes_are_ours_underneath():
    assert issubclass(compat.ScheduleGPipe, pippy_split.ScheduleGPipe)
    assert issubclass(compat.ScheduleGPipe, schedules.PipelineScheduleSingle)
    assert issubclass(compat.ScheduleZBVZeroBubble, pippy_split.ScheduleZBVZeroBubble)
    assert issubclass(compat.ScheduleZBVZeroBubble, schedules.PipelineScheduleMulti)
    assert not issubclass(compat.ScheduleZBVZeroBubble, schedules.PipelineScheduleSingle)
    assert issubclass(compat.PipelineStage, pippy_split.PipelineStage)
    assert issubclass(microbatch.TensorChunkSpec, pippy_split.TensorChunkSpec)
    assert compat.SplitPoint is pippy_split.SplitPoint and compat.pipe_split is pippy_split.pipe_split


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble",
                                  "PipelineScheduleSingle", "PipelineScheduleMulti", "ZBVZeroBubble", "DualPipeV"])
def test_get_schedule_class_names_as_the_peer(name):
    for spelling in (name, name.lower(), name.upper()):
        assert schedules.get_schedule_class(spelling).__name__ == peer_schedules.get_schedule_class(spelling).__name__


def test_unknown_schedule_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="ZBVZeroBubble"):
        schedules.get_schedule_class("ZeroBubbleV")


@pytest.mark.timeout(60)
def test_the_library_never_imports_the_peer():
    code = ("import sys, pippy_split, pippy_split.compat, pippy_split.compat.schedules, pippy_split.compat.stage, "
            "pippy_split.compat.microbatch; assert 'torch.distributed.pipelining' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
