"""The data helper: packed and length-bucketed microbatches for a token budget (pure, no ranks)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pippy_split as ps
from pippy_split.packing import bucket_by_length, pack_documents, step_inputs

docs_strategy = st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=40), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, budget=st.integers(2, 64))
def test_packing_keeps_every_token_in_order_within_the_budget(docs, budget):
    mbs = list(pack_documents(docs, budget, min_tokens=1))
    flat = [t for mb in mbs for t in mb.input_ids[0].tolist()]
    assert flat == [t for d in docs for t in d]  # nothing lost, nothing reordered, no padding
    for mb in mbs:
        assert mb.shape[0] == 1 and 1 <= mb.shape[1] <= budget
        assert mb.n_tokens == mb.shape[1]


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, budget=st.integers(2, 64))
def test_positions_restart_and_targets_stay_inside_each_document(docs, budget):
    for mb in pack_documents(docs, budget, min_tokens=1):
        ids, tgt, pos, doc = (t[0].tolist() for t in (mb.input_ids, mb.targets, mb.position_ids, mb.document_ids))
        for i in range(len(ids)):
            same_next = i + 1 < len(ids) and doc[i + 1] == doc[i]
            assert tgt[i] == (ids[i + 1] if same_next else -100)
            assert pos[i] == (0 if i == 0 or doc[i - 1] != doc[i] else pos[i - 1] + 1)
        mask = mb.attention_mask()[0, 0]
        for q in range(len(ids)):
            for k in range(len(ids)):
                assert bool(mask[q, k]) == (doc[q] == doc[k] and k <= q)
        lengths = mb.cu_seqlens().diff().tolist()
        assert sum(lengths) == len(ids) and len(lengths) == len(set(doc))


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, budget=st.integers(2, 64))
def test_buckets_pad_to_their_longest_within_the_budget(docs, budget):
    mbs = list(bucket_by_length(docs, budget, pad_id=0, window=8))
    pieces = sorted(p for d in docs for p in (tuple(d[i:i + budget]) for i in range(0, len(d), budget)))
    got = sorted(tuple(row[doc >= 0].tolist()) for mb in mbs for row, doc in zip(mb.input_ids, mb.document_ids))
    assert got == pieces
    for mb in mbs:
        rows, length = mb.shape
        assert rows * length <= budget or rows == 1
        assert ((mb.targets == -100) | (mb.document_ids >= 0)).all()
        assert int((mb.document_ids >= 0).sum(1).max()) == length  # padded to its own longest


def test_short_tail_is_merged_or_dropped_for_a_dim_minimum():
    mbs = list(pack_documents([[1, 2, 3, 4], [5]], max_tokens=4, min_tokens=2))
    assert [mb.shape[1] for mb in mbs] == [4]  # [5] alone is below the traced minimum of 2
    mbs = list(pack_documents([[1], [2, 3, 4, 5], [6, 7]], max_tokens=4, min_tokens=2))
    assert [mb.input_ids[0].tolist() for mb in mbs] == [[1, 2, 3, 4], [5, 6, 7]]  # [1] is too short alone: cut


def test_step_inputs_give_one_microbatches_per_field():
    mbs = list(pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_tokens=6))
    ids, tgt = step_inputs(mbs, "input_ids", "targets")
    assert isinstance(ids, ps.Microbatches) and [t.shape for t in ids] == [torch.Size([1, 5]), torch.Size([1, 4])]
    assert torch.equal(tgt[1], torch.tensor([[7, 8, 9, -100]]))


def test_a_packed_row_computes_each_document_as_if_alone():
    """The zoo's tiny Llama with documents= (what the pipelined packed tests rely on)."""
    from pippy_split import zoo

    model = zoo.get("tiny_llama").model
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 9, 3)]
    mb = next(pack_documents(docs, 32))
    packed = model(mb.input_ids, mb.position_ids, mb.document_ids)
    alone = torch.cat([model(torch.tensor([d]), torch.arange(len(d))[None]) for d in docs], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    # without documents= the later documents would attend to the earlier ones
    assert not torch.allclose(model(mb.input_ids, mb.position_ids), alone, atol=1e-3)
