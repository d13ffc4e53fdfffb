"""Balanced cuts on torchtitan's DeepSeek-V3 (MoE router with ``no_grad`` / autocast regions in its
forward), 4 stages, on the Trainer's meta model: the blocks a cut does not enter stay the user's
module calls, and ``pipeline_llm``'s split starts every stage at a block. ``ps.pipeline``'s own
balanced cuts land between blocks too: its dense first layer costs more than a MoE layer, and
whole blocks are within half a block of the best any cuts reach (``split/balance.py``,
``BLOCK_SLACK``), so no cut enters a block (before, one entered ``layers.0``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'pippy-split[torchtitan]' "
                                         "and, on CPU, pip install --no-deps triton==3.8.0)")

import pippy_split as ps  # noqa: E402
from pippy_split.integrations.torchtitan import _autocast_as_on, _block_starts  # noqa: E402

from .models import config  # noqa: E402

LAYERS, STAGES = 4, 4


@pytest.fixture(scope="module")
def split() -> tuple[torch.nn.Module, ps.Pipe, list[str] | None]:
    with torch.device("meta"):
        model = config("deepseek_v3", LAYERS).build()
    with _autocast_as_on(torch.device("cpu")):
        pipe = ps.pipeline(model, STAGES, (torch.zeros(1, 8, dtype=torch.long),))
        starts = _block_starts(pipe, model)
    assert torch.autocast is torch.amp.autocast_mode.autocast  # put back after the trace
    return model, pipe, starts


def _blocks(pipe: ps.Pipe, model: torch.nn.Module, i: int) -> tuple[list[str], list[str]]:
    """(blocks stage ``i`` calls as the user's objects, blocks a cut entered)."""
    held = [(n, m) for n, m in pipe.get_stage_module(i).named_modules() if n.count(".") == 1 and n.startswith("layers.")]
    return ([n for n, m in held if m is model.get_submodule(n)], [n for n, m in held if m is not model.get_submodule(n)])


@pytest.mark.timeout(300)
def test_uncut_moe_blocks_stay_module_calls(split) -> None:
    model, pipe, _ = split
    whole = [b for i in range(pipe.num_stages) for b in _blocks(pipe, model, i)[0]]
    moe = [f"layers.{i}" for i in range(1, LAYERS)]  # layers.0 is dense (n_dense_layers=1)
    assert set(moe) <= set(whole), whole


@pytest.mark.timeout(300)
def test_pipeline_llm_starts_every_stage_at_a_block(split) -> None:
    """The balanced cuts enter no block, so ``pipeline_llm`` keeps them; a cut that enters one (here
    given by FQN, inside ``layers.1``) is moved to that block's start."""
    model, pipe, starts = split
    assert starts is None
    with _autocast_as_on(torch.device("cpu")):
        inside = ps.pipeline(model, ["layers.1.moe"], (torch.zeros(1, 8, dtype=torch.long),))
    assert _blocks(inside, model, 1)[1] == ["layers.1"]
    assert _block_starts(inside, model) == ["layers.1"]


@pytest.mark.timeout(300)
def test_balanced_cuts_land_between_blocks(split) -> None:
    model, pipe, _ = split
    assert all(not _blocks(pipe, model, i)[1] for i in range(pipe.num_stages))
    assert [_blocks(pipe, model, i)[0] for i in range(pipe.num_stages)] == [[f"layers.{i}"] for i in range(LAYERS)]
