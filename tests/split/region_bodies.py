"""A model whose blocks run ``torch.no_grad()`` and ``torch.autocast`` regions inside their
forward, as MoE routers do (torchtitan's DeepSeek-V3 router), and its rank body (top-level so
it pickles for the ranks of ``test_region_calls.py``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import pippy_split as ps

D, VOCAB, EXPERTS, TOP_K, BLOCKS = 8, 16, 4, 2, 4
N_MB, MB, SEQ = 4, 2, 3


class Router(nn.Module):
    """Scores with a gradient; the choice of experts and the load counter under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).softmax(-1)  # (mb, T, E)
        with torch.no_grad():
            idx = scores.topk(TOP_K, -1).indices  # (mb, T, k)
            self.tokens_per_expert.add_(nn.functional.one_hot(idx, EXPERTS).sum((0, 1, 2)).float())
        return scores.gather(-1, idx), idx


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.router(x)
        with torch.autocast(x.device.type, enabled=False):  # experts in full precision (torchtitan's float32 region)
            out = torch.stack([torch.tanh(e(x)) for e in self.experts], -2)  # (mb, T, E, D)
        gate = torch.zeros(*x.shape[:-1], EXPERTS, dtype=x.dtype).scatter(-1, idx, weights)
        return (out * gate.unsqueeze(-1)).sum(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(D, D)
        self.feed_forward = MoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.attention(h))
        return h + self.feed_forward(h)


class RouterModel(nn.Module):
    """Token embedding (no FLOPs), ``BLOCKS`` equal blocks, a small head: an even split cuts
    between blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).squeeze(-1)  # (mb, T)


def case() -> tuple[RouterModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return RouterModel(), torch.randint(0, VOCAB, (N_MB * MB, SEQ), generator=g), torch.randn(N_MB * MB, SEQ, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def reference() -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The unsplit model over the same microbatches: mean loss, gradients, load counters."""
    model, x, y = case()
    total = 0.0
    for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB)):
        loss = loss_fn(model(xm), ym) / N_MB
        loss.backward()
        total += loss.item()
    counters = {n: b.clone() for n, b in model.named_buffers()}
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, counters


def step_1f1b(rank: int, world: int) -> dict:
    """One 1F1B step over 2 stages: loss, this rank's gradients and counters, and whether its
    blocks run as the user's modules (identity, a forward hook per microbatch)."""
    model, x, y = case()
    pipe = ps.pipeline(model, world, (x[:MB],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=loss_fn)
    (st,) = sched.stages
    calls = sorted(str(n.target) for n in st.module.graph.nodes if n.op == "call_module")
    fired: list[int] = []
    block = 2 * rank  # 2 blocks per stage
    handle = st.module.get_submodule(f"layers.{block}").register_forward_hook(lambda *_: fired.append(1))
    sched.step(x, target=y)
    handle.remove()
    names = {n for n, _ in st.module.named_parameters()}
    return {"loss": float(sched.loss), "calls": calls, "fired": len(fired),
            "same": st.module.get_submodule(f"layers.{block}") is model.layers[block],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if n in names},
            "counters": {n: b.clone() for n, b in st.module.named_buffers()}}


def step_per_block_fsdp(rank: int, world: int) -> dict:
    """1F1B over 2 stages with ``ps.parallelize`` sharding every block (``layers.*``) on its
    own with FSDP2 over a data-parallel mesh dimension of one rank: the pattern names modules
    the stages call (before: glue, refused by name)."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    model, x, y = case()
    pipe = ps.pipeline(model, world, (x[:MB],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=loss_fn, group=mesh["pp"])
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"])
    (st,) = sched.stages
    sharded = sorted(n for n, m in st.module.named_modules() if isinstance(m, FSDPModule))
    sched.step(x, target=y)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for n, p in st.module.named_parameters() if p.grad is not None}
    return {"loss": float(sched.loss), "sharded": sharded, "grads": grads}


def both_steps(rank: int, world: int) -> dict:
    """:func:`step_1f1b` then :func:`step_per_block_fsdp`, in one spawn of the ranks."""
    return {"plain": step_1f1b(rank, world), "fsdp": step_per_block_fsdp(rank, world)}
