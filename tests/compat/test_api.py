"""The drop-in's surface against torch.distributed.pipelining's (the peer's) public surface of
every recorded release (2.13.0, 2.14.1, 2.15.0 in ``peer_surfaces.json``) and of the installed
torch, whichever CI installs; and the library never imports the peer.

"Accepts" means every call the peer's signature admits is admitted here with the same meaning
of each position and default: the peer's positional parameters are ours in the same order,
kind and default; its keyword-only ones are ours with the same default; ours may add
parameters only with defaults (other releases' parameters, documented extras). A public
method of the peer that compat does not mirror is listed below with why, so a release that
adds one fails here until it is mirrored or listed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pippy_split
from pippy_split import compat
from pippy_split.compat import microbatch, schedules, stage
from pippy_split.schedule import ActionKind

from .peer_surface import MODULES, load, read_installed, read_source

RECORDED = load()
OURS = {"": compat, "schedules": schedules, "microbatch": microbatch, "stage": stage}

# the peer's public methods compat's classes do not have, and why
NOT_MIRRORED = {
    "PipelineStage": {
        # the peer's per-chunk runtime, which its schedules call; here the runtime drives a stage
        # through forward / backward / backward_input / backward_weight and the transport
        "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "forward_maybe_with_nosync",
        "backward_maybe_with_nosync", "get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops",
        "get_bwd_send_ops", "set_local_fwd_input", "set_local_bwd_input", "get_local_bwd_output",
        "clear_runtime_states", "release_fwd_send_outputs",
        # gradient scaling and FSDP reduction: here part of the step (the loss rule divides, FSDP2's
        # hooks reduce); step(finalize_gradients=False) defers the reduction
        "scale_grads", "perform_reduce_grad", "start_gradient_reduction", "wait_for_gradient_reduction",
    },
    # from_tracing: the peer's pipeline() calls it to trace; print_readable prints the peer's split
    # GraphModule; here print(pipe) shows the stages, their parameters, cost and edges
    "Pipe": {"from_tracing", "print_readable"},
}

# the peer's public properties compat's classes do not have, and why
NOT_MIRRORED_PROPERTIES = {
    "PipelineStage": {"has_backward"},  # set on a stage by the peer's schedules; here the schedule keeps it
}

# classes whose constructor is not the peer's, and why
CONSTRUCTED_OTHERWISE = {
    "Pipe": "pipeline() builds it; the peer's Pipe(split_gm, num_stages, ...) takes the peer's traced GraphModule",
}

# the peer's action IR (its private _ComputationType) in ours: a kind of ours, or why there is none
PEER_ACTION_KINDS = {
    "F": "F", "B": "B", "I": "I", "W": "W", "SEND_F": "SEND_F", "RECV_F": "RECV_F", "SEND_B": "SEND_B",
    "RECV_B": "RECV_B",
    "UNSHARD": "FSDP2's own pre-forward/pre-backward all-gather",
    "RESHARD": "FSDP2's own reshard after forward/backward",
    "REDUCE_GRAD": "FSDP2's reduce-scatter on each stage's last backward of the step",
    "WAIT_REDUCE_GRAD": "FSDP2 waits for its reduce-scatter itself",
    "WAIT_SEND_F": "a send stays in flight until delivered; delivered ones are freed during the step",
    "WAIT_SEND_B": "a send stays in flight until delivered; delivered ones are freed during the step",
    "OVERLAP_F_B": "no fused forward/backward action (DualPipeV runs F and B as two actions)",
}


def _installed() -> dict | None:
    try:
        return read_installed()
    except ImportError:
        return None


INSTALLED = _installed()
SURFACES = {**RECORDED, **({f"installed {torch.__version__}": INSTALLED} if INSTALLED else {})}


def _accepts(ours: list, theirs: list, where: str) -> list[str]:
    """What keeps a call that ``theirs`` admits from being admitted by ``ours`` (empty: none)."""
    problems = []
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    their_pos = [p for p in theirs if p[1] in positional]
    our_pos = [p for p in ours if p[1] in positional]
    if our_pos[:len(their_pos)] != their_pos:
        problems.append(f"{where}: positional {our_pos} do not start with the peer's {their_pos}")
    by_name = {p[0]: p for p in ours}
    for name, kind, default in theirs:
        if kind == "KEYWORD_ONLY":
            mine = by_name.get(name)
            if mine is None or mine[1] not in ("KEYWORD_ONLY", "POSITIONAL_OR_KEYWORD") or mine[2] != default:
                problems.append(f"{where}: the peer's keyword {name}={default} is {mine} here")
        elif kind in ("VAR_POSITIONAL", "VAR_KEYWORD") and not any(p[1] == kind for p in ours):
            problems.append(f"{where}: the peer takes {'*' if kind == 'VAR_POSITIONAL' else '**'}{name}")
    their_names = {p[0] for p in theirs}
    for name, kind, default in ours:
        if name not in their_names and kind in (*positional, "KEYWORD_ONLY") and default is None:
            problems.append(f"{where}: {name} is required here and absent in the peer")
    return problems


def _ours_described(obj) -> dict:
    from .peer_surface import _describe

    return _describe(obj, package="pippy_split")


def _instance(name: str):
    """An instance, for attributes set in ``__init__`` (a stage's ``is_first``)."""
    if name == "PipelineStage":
        return compat.PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"))
    return None


@pytest.mark.parametrize("version", sorted(SURFACES))
@pytest.mark.parametrize("module", list(MODULES), ids=lambda m: m or "pipelining")
def test_every_public_name_of_the_peer_is_there(version, module):
    theirs = SURFACES[version]["modules"][module]["all"]
    ours = OURS[module]
    missing = [n for n in theirs if n not in ours.__all__ or not hasattr(ours, n)]
    assert not missing, f"torch {version}: pippy_split.compat{'.' + module if module else ''} lacks {missing}"


@pytest.mark.parametrize("version", sorted(SURFACES))
@pytest.mark.parametrize("module", list(MODULES), ids=lambda m: m or "pipelining")
def test_every_signature_accepts_the_peers_calls(version, module):
    problems = []
    for name, theirs in SURFACES[version]["modules"][module]["names"].items():
        obj = getattr(OURS[module], name)
        ours = _ours_described(obj)
        assert ours["kind"] == theirs["kind"], f"torch {version}: {name} is a {theirs['kind']} in the peer"
        if theirs["kind"] == "function":
            problems += _accepts(ours["params"], theirs["params"], name)
        elif theirs["kind"] == "enum":
            assert ours["members"] == theirs["members"], name
        elif theirs["kind"] == "class":
            problems += _class_problems(name, obj, theirs)
    assert not problems, f"torch {version}:\n" + "\n".join(problems)


def _class_problems(name: str, cls: type, theirs: dict) -> list[str]:
    problems = []
    ours = _ours_described(cls)
    if "fields" in theirs:  # a dataclass: its public fields (the peer's PipelineActivationLiveness has a
        # private one, named otherwise here)
        public = [f for f in theirs["fields"] if not f.startswith("_")]
        missing = [f for f in public if f not in ours.get("fields", [])]
        problems += [f"{name}: no field {missing}"] if missing else []
        if not any(p[0].startswith("_") for p in theirs["init"]):
            problems += _accepts(ours["init"], theirs["init"], f"{name}()")
    elif name not in CONSTRUCTED_OTHERWISE:
        problems += _accepts(_without_var_keyword(name, ours["init"]), theirs["init"], f"{name}()")
    for method, params in theirs["methods"].items():
        if method in NOT_MIRRORED.get(name, set()):
            continue
        if method not in ours["methods"]:
            problems.append(f"{name}.{method}: missing (mirror it, or list it in NOT_MIRRORED with why)")
        else:
            problems += _accepts(ours["methods"][method], params, f"{name}.{method}")
    instance = _instance(name)
    for prop in theirs["properties"]:
        if prop not in NOT_MIRRORED_PROPERTIES.get(name, set()) and not hasattr(cls, prop) \
                and not hasattr(instance, prop):
            problems.append(f"{name}.{prop}: no such property")
    return problems


def _without_var_keyword(name: str, params: list) -> list:
    """compat.PipelineStage takes pippy_split's own stage options as ``**options`` (an extra on purpose)."""
    return [p for p in params if not (name == "PipelineStage" and p[1] == "VAR_KEYWORD")]


@pytest.mark.parametrize("version", sorted(SURFACES))
def test_no_method_listed_as_not_mirrored_is_mirrored_after_all(version):
    for name, skipped in NOT_MIRRORED.items():
        theirs = {m for mod in SURFACES[version]["modules"].values() if name in mod["names"]
                  for m in mod["names"][name]["methods"]}
        ours = _ours_described(getattr(compat, name))["methods"]
        assert not (skipped & theirs & set(ours)), name


@pytest.mark.parametrize("version", sorted(SURFACES))
def test_every_action_kind_of_the_peer_has_its_equivalent(version):
    kinds = SURFACES[version]["action_kinds"]
    assert set(kinds) <= set(PEER_ACTION_KINDS), set(kinds) - set(PEER_ACTION_KINDS)
    ours = {k.value for k in ActionKind}
    assert {k for k in kinds if PEER_ACTION_KINDS[k] == k} <= ours


def test_no_parameter_here_is_unknown_to_every_release():
    """compat's schedules add nothing of their own to the peer's step/eval/constructors."""
    union: dict[str, set] = {}
    for surface in RECORDED.values():
        for name, entry in surface["modules"]["schedules"]["names"].items():
            if entry["kind"] == "class" and "Schedule" in name:
                for where, params in [("__init__", entry["init"]), *entry["methods"].items()]:
                    union.setdefault(f"{name}.{where}", set()).update(p[0] for p in params)
    for key, names in union.items():
        name, where = key.split(".")
        obj = getattr(schedules, name)
        desc = _ours_described(obj)
        params = desc["init"] if where == "__init__" else desc["methods"].get(where, [])
        extra = {p[0] for p in params} - names
        assert not extra, f"{key}: {extra} is in no release of the peer"


@pytest.mark.skipif(INSTALLED is None, reason="torch.distributed.pipelining is not importable")
def test_the_recorder_reads_the_installed_peer_as_its_source():
    """ast over the installed files == inspect over the imported modules: the recorded releases,
    read with ast, are read as an import would see them."""
    import torch.distributed.pipelining as peer

    assert read_source(Path(peer.__file__).parent) == INSTALLED


@pytest.mark.skipif(INSTALLED is None, reason="torch.distributed.pipelining is not importable")
def test_a_recorded_release_equal_to_the_installed_one_is_its_surface():
    version = torch.__version__.split("+")[0]
    if version not in RECORDED:
        pytest.skip(f"torch {version} is not recorded; its surface is checked as 'installed'")
    assert RECORDED[version] == INSTALLED


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
    peer_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for spelling in (name, name.lower(), name.upper()):
        assert schedules.get_schedule_class(spelling).__name__ == peer_schedules.get_schedule_class(spelling).__name__
    # the peer's private common base, which code written for it names (the peer's own test of this)
    assert issubclass(schedules.get_schedule_class(name), schedules._PipelineSchedule)


def test_unknown_schedule_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="ZBVZeroBubble"):
        schedules.get_schedule_class("ZeroBubbleV")


@pytest.mark.timeout(60)
def test_the_library_never_imports_the_peer():
    code = ("import sys, pippy_split, pippy_split.compat, pippy_split.compat.schedules, pippy_split.compat.stage, "
            "pippy_split.compat.microbatch; assert 'torch.distributed.pipelining' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
