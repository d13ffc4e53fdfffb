"""Edge dtypes under mixed precision come from the split traced under the same autocast,
where the real ops ran (issue 29 item 4): a stage whose graph fake tensors cannot run (a
check on a value read with ``.item()``, as LLaVA's on its image tokens) trains exactly (one
process; HF LLaVA and DeepSeek-V3 are in the real-architecture matrix)."""

from __future__ import annotations

import torch
from torch import nn

import pippy_split as ps
from pippy_split.stage.mixed_precision import autocast_edge_specs


class Experts(nn.Module):
    """Tokens in equal groups, one weight per group (a MoE's expert matmuls as one bmm)."""

    def __init__(self, d: int = 8, e: int = 2) -> None:
        super().__init__()
        self.e = e
        self.w = nn.Parameter(torch.randn(e, d, d) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (n, d)
        return torch.bmm(h.unflatten(0, (self.e, -1)), self.w).flatten(0, 1)


class Model(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.norm, self.experts, self.out = nn.Linear(d, d), nn.LayerNorm(d), Experts(d), nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        torch._check((mask.sum() == h.shape[0]).item())  # LLaVA checks its image tokens like this
        return self.out(self.experts(self.norm(h).float())).squeeze(-1)  # fp32 experts under autocast


def _loss(out, y):
    return ((out.float() - y) ** 2).sum()


def test_a_stage_fake_tensors_cannot_run_learns_its_edges_from_the_autocast_trace():
    torch.manual_seed(0)
    model, x, mask, y = Model(), torch.randn(16, 8), torch.ones(16, dtype=torch.bool), torch.randn(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xm, mm, ym in zip(x.chunk(4), mask.chunk(4), y.chunk(4)):
            (_loss(model(xm, mm), ym) / 4).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe = ps.pipeline(model, ["norm", "experts"], (x[:4], mask[:4]))
    bf16 = pipe.under_autocast(torch.bfloat16)
    specs = autocast_edge_specs(bf16, torch.bfloat16, "cpu")
    assert [specs[id(e)].dtype for e in bf16.edges if e.src_stage >= 0] == [torch.bfloat16, torch.float32]
    assert [e.dst_stage for e in bf16.edges if e.src_stage >= 0] == [1, 2]
    # before: "could not run under torch.autocast ... (DataDependentOutputException: aten._local_scalar_dense)"
    sched = ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=_loss, mixed_precision=torch.bfloat16)
    sched.step(x, mask, target=y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=n)
