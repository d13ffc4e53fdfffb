"""compat schedules chunk each input tensor by its own size, as torch.distributed.pipelining
does: a keyword argument whose dim 0 differs from the positional ones' (8 rows beside 64) is
fine there, so it is here; pippy_split's own API keeps requiring chunked arguments to agree.

Pure tier: every stage in this process, no process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.pipelining.microbatch as peer
import torch.nn.functional as F
from torch import nn

import pippy_split as ps
from pippy_split import compat
from pippy_split.compat import schedules as S
from pippy_split.compat.microbatch import peer_chunk_specs

N_MB = 4
ROWS, STYLE_ROWS = 64, 8  # x has 64 rows, the style kwarg 8: each microbatch gets 16 and 2


class Styled(nn.Module):
    """Rows of ``x`` scaled by the mean of a few ``style`` rows (a batch of its own size)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) * style.mean(0))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 4, generator=g), torch.randn(STYLE_ROWS, 8, generator=g), torch.randn(ROWS, 2, generator=g)


def _reference(model: nn.Module, x, style, target) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model on the peer's microbatches (each tensor chunked on its own): outputs, mean-loss grads."""
    model.zero_grad()
    args, kwargs = peer.split_args_kwargs_into_chunks((x,), {"style": style}, N_MB)
    outs = []
    for (xs,), kw, ts in zip(args, kwargs, target.tensor_split(N_MB)):
        out = model(xs, **kw)
        (F.mse_loss(out, ts) / N_MB).backward()
        outs.append(out.detach())
    return torch.cat(outs), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, n_stages", [("GPipe", 1), ("ZBVZeroBubble", 2)])
def test_step_chunks_a_kwarg_of_another_batch_size_like_the_peer(name, n_stages):
    torch.manual_seed(0)
    model = Styled()
    x, style, target = _inputs()
    split = {"head": compat.SplitPoint.BEGINNING} if n_stages == 2 else None
    pipe = compat.pipeline(model, (x[: ROWS // N_MB],), {"style": style[: STYLE_ROWS // N_MB]}, split_spec=split)
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in range(n_stages)]
    cls = S.get_schedule_class(name)
    sched = cls(stages[0] if n_stages == 1 else stages, N_MB, loss_fn=F.mse_loss)

    out = sched.step(x, style=style, target=target)

    want_out, want_grads = _reference(model, x, style, target)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=0)
    got = {n: p.grad for st in stages for n, p in st.submod.named_parameters()}
    assert set(got) == set(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(got[n], g, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(sched.eval(x, style=style), want_out, atol=1e-5, rtol=0)


def test_the_core_api_keeps_requiring_agreement():
    x, style, _ = _inputs()
    with pytest.raises(ps.microbatch.MicrobatchError, match="chunked arguments must agree"):
        ps.split_args_kwargs((x,), {"style": style}, N_MB)


def test_peer_chunk_specs_split_like_the_peer_and_refuse_too_few_rows():
    x, style, _ = _inputs()
    specs = peer_chunk_specs((x,), {"style": style}, N_MB)
    ours = ps.split_args_kwargs((x,), {"style": style}, N_MB, *specs)
    theirs_args, theirs_kwargs = peer.split_args_kwargs_into_chunks((x,), {"style": style}, N_MB)
    for (a, k), pa, pk in zip(ours, theirs_args, theirs_kwargs):
        assert torch.equal(a[0], pa[0]) and torch.equal(k["style"], pk["style"])
    with pytest.raises(ps.microbatch.MicrobatchError, match=r"kwargs\['style'\] has shape \(2, 8\): 2 entries"):
        peer_chunk_specs((x,), {"style": style[:2]}, N_MB)
