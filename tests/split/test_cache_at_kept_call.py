"""A module call that returns a cache object keeps its call signature (issue 39).

HF ``ReformerModelWithLMHead`` with its default config (``use_cache=True``): the encoder, which
applies the reversible ``torch.autograd.Function``, returns a ``ReformerDynamicCache``. The
stage must call the encoder as the user's module (only there does the Function's own backward
run), so its signature is kept with a constant in place of the cache, as the model's own
outputs are treated. Before: ``TraceError ... Only Tensors or scalars are supported as pytree
flattened inputs, got: ReformerDynamicCache``. One process (V: both stages), one trace, one step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import pippy_split as ps

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, N_MB, MB = 128, 8, 4, 2


def _reformer() -> torch.nn.Module:
    cfg = transformers.ReformerConfig(
        vocab_size=VOCAB, hidden_size=32, attention_head_size=8, num_attention_heads=4, attn_layers=["local"] * 2,
        axial_pos_shape=[2, 4], axial_pos_embds_dim=[16, 16], feed_forward_size=64, local_attn_chunk_length=4,
        local_num_chunks_before=1, local_num_chunks_after=0, max_position_embeddings=SEQ, is_decoder=True,
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=2)
    assert cfg.use_cache  # the default config, as shipped
    torch.manual_seed(0)
    return transformers.ReformerModelWithLMHead(cfg).train()  # its reversible backward refuses eval mode


def _loss(out, _target):
    return out.loss


def test_reformer_with_its_default_cache_splits_and_trains_exactly():
    model = _reformer()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (N_MB * MB, SEQ), generator=g)
    labels = ids.clone()
    labels[::2, -3:] = -100
    for i in range(N_MB):
        sl = slice(i * MB, (i + 1) * MB)
        (model(ids[sl], labels=labels[sl]).loss / N_MB).backward()
    want = {n: p.grad for n, p in model.named_parameters()}  # None where a parameter is unused
    with torch.no_grad():
        want_loss = sum(float(model(ids[i * MB:(i + 1) * MB], labels=labels[i * MB:(i + 1) * MB]).loss)
                        for i in range(N_MB)) / N_MB
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ps.pipeline(model, 2, (ids[:MB],), {"labels": labels[:MB]})  # every signature asked for
    assert not [w for w in caught if "could not keep" in str(w.message)], [str(w.message) for w in caught]
    first = pipe.get_stage_module(0)
    calls = [str(n.target) for n in first.graph.nodes if n.op == "call_module"]
    assert "reformer.encoder" in calls or "reformer" in calls, calls  # called whole: the Function's backward runs
    assert first.get_submodule("reformer.encoder") is model.reformer.encoder
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", N_MB, loss_fn=_loss)  # both stages here
    sched.step(ids, labels=labels, target=labels)
    assert abs(float(sched.loss) - want_loss) < 1e-5
    assert any(g is not None for n, g in want.items() if n.startswith("reformer.encoder.layers.1."))  # the Function's
    for n, p in model.named_parameters():
        if want[n] is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-5, msg=n)
