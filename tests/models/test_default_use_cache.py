"""Every causal LM of the real-architecture matrix splits between its blocks with ``use_cache``
as its config class ships it (the matrix builds most with ``use_cache=False``): the pipe's
forward equals the model's on the same microbatch, its loss included (issue 39). Reformer, whose
cache object sits at a kept module call and which no cut may enter below its encoder, has its
own test (``tests/split/test_cache_at_kept_call.py``)."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from tests.generate.archs import MATRIX, blocks

from . import hf_archs

CAUSAL = MATRIX


def shipped(name: str) -> hf_archs.Arch:
    arch = hf_archs.build(name)
    cfg = arch.model.config
    cfg.use_cache = type(cfg)().use_cache  # the config class's own default
    return arch


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CAUSAL)
def test_splits_with_use_cache_as_shipped(name: str) -> None:
    arch = shipped(name)
    model = arch.model
    assert model.config.use_cache is True, "the config class no longer ships use_cache=True"
    mb_args = tuple(a[: hf_archs.MB] for a in arch.args)
    mb_kwargs = {k: v[: hf_archs.MB] for k, v in arch.kwargs.items()}
    fqn = blocks(model)
    pipe = ps.pipeline(model, [f"{fqn}.{len(model.get_submodule(fqn)) // 2}"], mb_args, mb_kwargs)
    torch.manual_seed(0)
    want = model(*mb_args, **mb_kwargs)
    torch.manual_seed(0)
    got = pipe(*mb_args, **mb_kwargs)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=0)
