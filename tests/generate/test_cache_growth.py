"""A lane's KV cache grows in place, one buffer a call (generate/cache_growth.py): the step's
keys and values are written after the past instead of copying the whole past each step, with
the values the ``cat`` gives, and never over what another view of the same buffer holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pippy_split as ps
from pippy_split.generate.cache_growth import grow_cache, with_room
from pippy_split.generate.eager import eager_program
from pippy_split.generate.stage_step import StageDecoder

from .models import hf_model, hf_reference, prompts


def test_a_past_with_room_grows_in_place_with_the_values_of_cat() -> None:
    past = with_room(torch.zeros(2, 3, 0, 4), 2, 6)
    parts = [torch.randn(2, 3, 2, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 3, 3, 4)]
    grown = past
    for p in parts:
        before = grown
        grown = grow_cache(grown, p, -2)
        assert grown._base is past._base and grown.storage_offset() == 0  # the same buffer: nothing copied
        assert torch.equal(grown, torch.cat([before, p], 2))
    assert torch.equal(grown, torch.cat(parts, 2))
    last = torch.randn(2, 3, 1, 4)
    moved = grow_cache(grown, last, 2)  # outgrown: a buffer with as much room again (6), filled to 7
    assert moved._base is not past._base and moved._base.shape[2] == 13
    assert torch.equal(moved, torch.cat([grown, last], 2))
    again = grow_cache(moved, last, 2)
    assert again._base is moved._base and torch.equal(again, torch.cat([moved, last], 2))


def test_a_branch_of_the_same_past_is_copied_never_written_over_the_longer_one() -> None:
    base = grow_cache(with_room(torch.zeros(1, 2, 0, 2), 2, 8), torch.randn(1, 2, 2, 2), 2)
    longer = grow_cache(base, torch.randn(1, 2, 1, 2), 2)
    kept = longer.clone()
    branch = grow_cache(base, torch.randn(1, 2, 1, 2), 2)  # base no longer ends where the buffer is filled
    assert branch._base is None
    assert torch.equal(longer, kept) and torch.equal(branch[:, :, :2], base)


@pytest.mark.parametrize("case", ["made without room", "other dtype", "a tensor of its own", "grad", "rows of it"])
def test_anything_else_is_the_cat_it_replaces(case: str) -> None:
    past = with_room(torch.zeros(1, 2, 0, 2), 2, 0 if case == "made without room" else 4)
    new = torch.randn(1, 2, 1, 2, dtype=torch.float64 if case == "other dtype" else torch.float32)
    if case == "a tensor of its own":
        past = torch.randn(1, 2, 3, 2)
    if case == "grad":
        new.requires_grad_(True)
    if case == "rows of it":  # a view of the buffer's first row only: it must not grow every row
        past = grow_cache(with_room(torch.zeros(2, 2, 0, 2), 2, 4), torch.randn(2, 2, 1, 2), 2)[:1]
    out = grow_cache(past, new, 2)
    assert torch.equal(out, torch.cat([past, new], 2)) and out.dtype == torch.cat([past, new], 2).dtype
    assert out._base is None


def _cache_tensors(cache: Any) -> dict[Any, torch.Tensor]:
    """A lane's cache tensors on a stage: the traced program's (index -> tensor) or, of the eager
    program's cache object, this stage's layers' keys and values."""
    if isinstance(cache, dict):
        return cache
    return {(j, kv): t for j, layer in enumerate(cache.layers) if not hasattr(layer, "length")
            for kv, t in enumerate((layer.keys, layer.values)) if t is not None}


def _pipe(program: str) -> tuple[Any, Any]:
    """An HF Llama, cut at a layer, decoding with the ``program`` asked for."""
    model, spec = hf_model("llama")
    pipe = ps.pipeline(model, spec, (prompts(True)[0][:2],))
    if program == "traced":
        pipe.derived["eager_program"] = None
    else:
        assert type(eager_program(pipe)).__name__ == "EagerProgram"
    return model, pipe


def _buffers_a_cache(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[tuple[int, int, int], set[int]], list[int]]:
    """Records, per (stage, lane, cache tensor), the buffers its values lived in, and counts steps."""
    seen: dict[tuple[int, int, int], set[int]] = {}
    steps = [0]
    run = StageDecoder.run

    def recording(self: StageDecoder, lane: int, step: list, produced: dict) -> tuple:
        out = run(self, lane, step, produced)
        steps[0] += 1
        for j, t in _cache_tensors(self.cache[lane]).items():
            seen.setdefault((self.s, lane, j), set()).add(t.data_ptr())
        return out

    monkeypatch.setattr(StageDecoder, "run", recording)
    return seen, steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("program", ["traced", "eager"])
def test_a_lane_keeps_its_keys_in_one_buffer_through_a_call(monkeypatch: pytest.MonkeyPatch, program: str) -> None:
    """Before, every step concatenated: a new tensor the size of the whole past, each step."""
    model, pipe = _pipe(program)
    ids, mask = prompts(True)
    seen, _ = _buffers_a_cache(monkeypatch)
    n_new = 6
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=n_new, return_logprobs=True)
    assert seen and all(len(ptrs) == 1 for ptrs in seen.values()), seen
    ref, ref_logprobs = hf_reference(model, ids, mask, n_new)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref)
    torch.testing.assert_close(out.logprobs[:, : ref.shape[1] - ids.shape[1]], ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("program", ["traced", "eager"])
def test_a_refilled_lane_outgrows_its_buffer_into_a_few_more(monkeypatch: pytest.MonkeyPatch, program: str) -> None:
    """One slot for every prompt: the lane's cache grows to several buffers' worth; it moves to a
    new buffer each time it fills one (a few moves), not each step, and the tokens are HF's."""
    model, pipe = _pipe(program)
    ids, mask = prompts(True)
    eos = [3, 68]
    ref, _ = hf_reference(model, ids, mask, 4, eos_token_id=eos, pad_token_id=0)
    seen, steps = _buffers_a_cache(monkeypatch)
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=eos, pad_token_id=0, lanes=1,
                        slots=1)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref)
    rounds = steps[0] // pipe.num_stages
    capacity = ids.shape[1] + 4  # the first buffer; each later one adds as much again
    for ptrs in seen.values():
        assert 1 < len(ptrs) <= 1 + rounds // capacity, (len(ptrs), rounds)
