"""A message keeps its tensor's memory layout: what the trace records (``TensorSpec.dim_order``)
and what the transport sends and rebuilds. Pure tier; across ranks: tests/dist/test_layout.py.

Run: python -m pytest tests/stage/test_layout_transport.py -q -p no:cacheprovider
"""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split.split.symbols import dim_order_of
from pippy_split.stage.transport import P2P, Batch
from tests.dist.layout_bodies import build


def test_dim_order_is_recorded_only_where_memory_is_not_row_major():
    assert dim_order_of(torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)) == (0, 2, 3, 1)
    assert dim_order_of(torch.zeros(2, 3, 4).transpose(1, 2)) == (0, 2, 1)
    assert dim_order_of(torch.zeros(2, 3)) is None


def test_a_cut_through_a_channels_last_value_records_its_order():
    model, x, _ = build()
    pipe = ps.pipeline(model, ["dw"], (x[:2],))
    assert [e.spec.dim_order for e in pipe.edges] == [(0, 2, 3, 1)]


def _delivered(value: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """What a receive of ``value``'s send returns (the wire: a copy of the sent buffer)."""
    sent = P2P.send_op(value, peer=1, what="send", dim_order=order)
    recv, _ = P2P.recv_op(tuple(value.shape), value.dtype, value.device, peer=0, what="recv", dim_order=order)
    recv.tensor.copy_(sent.tensor)
    recv.batch = Batch([], ["recv"], done=True)
    return P2P().wait_recv(recv), sent.tensor


def test_a_channels_last_message_is_sent_without_a_copy_and_received_channels_last():
    value = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    got, sent = _delivered(value, (0, 2, 3, 1))
    assert sent.data_ptr() == value.data_ptr() and sent.is_contiguous()
    assert got.stride() == value.stride() and torch.equal(got, value)


def test_a_value_in_another_layout_than_traced_arrives_with_the_right_values():
    value = torch.randn(2, 8, 5, 5)  # row-major, though the trace said channels-last
    got, _ = _delivered(value, (0, 2, 3, 1))
    assert torch.equal(got, value) and got.is_contiguous(memory_format=torch.channels_last)


def test_complex_values_keep_their_layout_too():
    value = torch.randn(2, 3, 4, dtype=torch.complex64).transpose(1, 2)
    got, _ = _delivered(value, (0, 2, 1))
    assert torch.equal(got, value) and got.stride() == value.stride()
