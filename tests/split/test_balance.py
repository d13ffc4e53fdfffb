"""The int-N balancer: where it may cut, what it prefers, the cost models, the warning.

Pure tier (no process group). Real architectures are in ``tests/models``; these are the
smallest models that show one behaviour each.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import pippy_split as ps
from pippy_split import zoo
from pippy_split.split.balance import TARGET_RATIO, legal_cuts
from pippy_split.split.calls import call_tree
from pippy_split.split.cost import node_flops
from pippy_split.split.trace import trace_model
from tests.split.helpers import assert_same_grads, assert_same_outputs, assert_state_dict_partition, stage_keys


def _ops(model: nn.Module, *args: torch.Tensor) -> list[torch.fx.Node]:
    return [n for n in trace_model(model, args).graph.nodes if n.op == "call_function"]


def _quiet_pipeline(*args, **kwargs) -> tuple[ps.Pipe, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ps.pipeline(*args, **kwargs)
    return pipe, [str(w.message) for w in caught if str(w.message).startswith("pipeline(model,")]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class SharedLayer(nn.Module):
    """ALBERT's shape: one block module called ``calls`` times, between two small linears
    and a top-level op (which made enough pieces for the old balancer to stop looking)."""

    def __init__(self, d: int = 16, calls: int = 8) -> None:
        super().__init__()
        self.inp, self.layer, self.out, self.calls = nn.Linear(d, d), Block(d), nn.Linear(d, d), calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for _ in range(self.calls):
            x = self.layer(x)
        return self.out(x)


class SequentialBlocks(nn.Module):
    """ViT's shape: all blocks inside one ``nn.Sequential`` container, between a stem, a
    head and cheap ops at the root."""

    def __init__(self, d: int = 16, n: int = 8) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(d, d), nn.Linear(d, d)
        self.pos = nn.Parameter(torch.zeros(d))
        self.encoder = nn.Module()
        self.encoder.layers = nn.Sequential(*[Block(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x) + self.pos
        return self.head(self.encoder.layers(x).tanh())


def test_cuts_between_repeated_calls_of_one_shared_module():
    """Before, every call of ``layer`` fell in one piece: [inp, layer x8, out] gave stage
    shares like [97%, 3%]."""
    torch.manual_seed(0)
    model, x = SharedLayer(), torch.randn(4, 16)
    for n in (2, 4):
        pipe, warned = _quiet_pipeline(model, n, (x,))
        assert pipe.balance.ratio <= TARGET_RATIO and not warned, pipe.balance.shares
        assert_same_outputs(pipe(x), model(x))
    # The shared weights live in every stage that calls the layer; their gradients are summed.
    assert "layer.fc1.weight" in pipe.shared_parameters
    assert_same_grads(pipe, model, (x,), {})


def test_cuts_inside_one_sequential_container():
    """Before, the root's cheap ops made enough pieces at depth 1, so the whole
    ``encoder.layers`` stayed one piece: shares [0%, 100%] (torchvision's ViT)."""
    torch.manual_seed(0)
    model, x = SequentialBlocks(), torch.randn(4, 16)
    for n in (2, 4):
        pipe, _ = _quiet_pipeline(model, n, (x,))
        assert pipe.balance.ratio <= TARGET_RATIO, pipe.balance.shares
        assert_same_outputs(pipe(x), model(x))
        assert_state_dict_partition(pipe, model)


def test_prefers_block_boundaries():
    """8 blocks into 4 stages: two whole blocks a stage, not a cut inside a block."""
    e = zoo.get("tiny_gpt", n_layer=8)
    pipe = ps.pipeline(e.model, 4, e.args)
    blocks = [sorted({k.split(".")[1] for k in keys if k.startswith("blocks.")}) for keys in stage_keys(pipe)]
    assert blocks == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert [e.dst_stage for e in pipe.edges] == [1, 2, 3]  # one hidden state per cut


def test_cuts_inside_blocks_when_whole_blocks_cannot_balance():
    """9 blocks into 4 stages: whole blocks give at best 3/2.25 = 1.33x; cutting inside
    one (between attention and MLP) gets under the target."""
    e = zoo.get("tiny_gpt", n_layer=9)
    pipe, warned = _quiet_pipeline(e.model, 4, e.args)
    assert pipe.balance.ratio <= TARGET_RATIO and not warned, pipe.balance.shares
    assert_same_outputs(pipe(*e.args), e.model(*e.args))


def test_warning_names_the_best_ratio_and_the_indivisible_piece():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 8))
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"pipeline\(model, 3, balance='flops'\): stage \d costs [\d.]+x an even "
                                         r"stage.*the best any cuts can do is [\d.]+x.*no cut can enter is module '1' "):
        pipe = ps.pipeline(model, 3, (x,))
    assert pipe.balance.best_ratio > TARGET_RATIO
    assert pipe.balance.indivisible[0] == "module '1'"
    assert_same_outputs(pipe(x), model(x))


class Awkward(nn.Module):
    """Values a cut must not separate: an in-place write to an earlier result, a tuple
    and its getitems, and a tensor whose size depends on data."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = torch.sigmoid(h)
        h.mul_(2)                                     # writes h, made two ops before
        lo, hi = torch.chunk(self.b(g + h), 2, dim=1)  # a tuple, then getitems
        picked = hi[hi[:, 0] > 0]                     # (?, 4): size depends on data
        return self.c(torch.cat([lo, hi], 1)) + picked.sum()


def test_never_cuts_where_values_cannot_cross():
    torch.manual_seed(0)
    model, x = Awkward(), torch.randn(4, 8)
    ops = _ops(model, x)
    legal, crossing = legal_cuts(ops)
    index = {op.name: i for i, op in enumerate(ops)}
    mul_ = next(op for op in ops if "mul_" in str(op.target))
    h = mul_.args[0]
    assert not any(legal[index[h.name] + 1:index[mul_.name] + 1])
    chunk = next(op for op in ops if "chunk" in str(op.target) or "split" in str(op.target))
    last_getitem = max(index[u.name] for u in chunk.users)
    assert not any(legal[index[chunk.name] + 1:last_getitem + 1])
    nonzero = next(op for op in ops if op.target in (torch.ops.aten.nonzero.default, torch.ops.aten.index.Tensor))
    picked_sum = next(op for op in ops if op.target is torch.ops.aten.sum.default)
    assert not legal[index[picked_sum.name]]  # between the data-sized value and its reader
    assert legal[0] and crossing[0] == 0
    assert nonzero is not None
    for n in range(2, 6):
        pipe, _ = _quiet_pipeline(model, n, (x,))
        assert pipe.num_stages == n
        assert_same_outputs(pipe(x), model(x))


@pytest.mark.parametrize("balance", ["params", "memory", "time"])
def test_each_cost_model_balances_and_is_reported(balance):
    e = zoo.get("tiny_gpt", n_layer=8)
    pipe, warned = _quiet_pipeline(e.model, 4, e.args, balance=balance)
    assert pipe.balance.metric == balance and not warned
    assert pipe.balance.ratio <= TARGET_RATIO, pipe.balance.shares
    assert math.isclose(sum(pipe.balance.shares), 1.0)
    assert f"{balance} share" in str(pipe)
    assert_same_outputs(pipe(*e.args), e.model(*e.args))


def test_params_counts_each_tensor_once_at_its_first_reader():
    e = zoo.get("tied_lm")  # head.weight IS tok_emb.weight
    pipe = ps.pipeline(e.model, 2, e.args, balance="params")
    unique = {id(p): p for p in e.model.parameters()}
    assert pipe.balance.total == sum(p.numel() * p.element_size() for p in unique.values())


def test_memory_counts_training_state_and_activations():
    model, x = nn.Linear(16, 16), torch.randn(4, 16)
    pipe = ps.pipeline(model, None, (x,), balance="memory")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pipe.balance.total == 4 * weights + 4 * 16 * 4  # weight, grad, 2 Adam moments; the output


def test_time_is_measured_without_touching_the_model():
    """BatchNorm in train mode updates its running stats in place, dropout draws random
    numbers: measuring time must do neither to the model or the caller's RNG."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8)).train()
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    pipe, _ = _quiet_pipeline(model, 2, (x,), balance="time")
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(c > 0 for c in pipe.balance.stage_costs)


def test_time_needs_real_tensors():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(2, 8, device="meta")
    with pytest.raises(ps.SplitError, match="meta device; use balance='flops'"):
        ps.pipeline(model, 2, (x,), balance="time")
    assert ps.pipeline(model, 2, (x,)).num_stages == 2  # FLOPs need no real tensors


def test_unknown_balance_is_refused_before_tracing():
    class Untraceable(nn.Module):
        def forward(self, x):
            raise AssertionError("traced")

    with pytest.raises(ValueError, match="balance must be one of 'flops', 'params', 'time', 'memory'; got 'speed'"):
        ps.pipeline(Untraceable(), 2, (torch.ones(1),), balance="speed")


def test_summary_shows_each_stage_share():
    e = zoo.get("mlp_stack", n_layer=8)
    text = str(ps.pipeline(e.model, 4, e.args))
    assert "flops share" in text and text.count(" 25% ") == 4
    assert "costliest stage: 1.00x an even one (total / 4) by flops" in text
    fqn_split = str(ps.pipeline(e.model, ["layers.2"], e.args))  # a hand-made split shows shares too
    assert " 25% " in fqn_split and " 75% " in fqn_split


def test_conv_flops_count_the_kernel():
    """Export keeps ``aten.conv2d``, which torch's FLOP table lacks: it used to count one
    FLOP per output element."""
    conv, x = nn.Conv2d(3, 8, 3, padding=1, groups=1), torch.randn(2, 3, 10, 10)
    (op,) = [o for o in _ops(conv, x) if "conv" in str(o.target)]
    assert node_flops(op) == 2 * (2 * 8 * 10 * 10) * (3 * 3 * 3)
    dw = nn.Conv2d(8, 8, 5, padding=2, groups=8)
    (op,) = [o for o in _ops(dw, torch.randn(1, 8, 6, 6)) if "conv" in str(o.target)]
    assert node_flops(op) == 2 * (8 * 6 * 6) * (1 * 5 * 5)
    up = nn.ConvTranspose2d(4, 2, 2, stride=2)
    (op,) = [o for o in _ops(up, torch.randn(1, 4, 3, 3)) if "conv" in str(o.target)]
    assert node_flops(op) == 2 * (4 * 3 * 3) * (2 * 2 * 2)


def test_views_cost_nothing():
    class Views(nn.Module):
        def forward(self, x):
            return x.view(4, 4).t().reshape(-1)[1:].unsqueeze(0).exp()

    ops = _ops(Views(), torch.randn(16))
    assert [node_flops(op) for op in ops if "exp" not in str(op.target)] == [0] * (len(ops) - 1)
    assert node_flops(next(op for op in ops if "exp" in str(op.target))) == 15


def test_call_tree_tells_repeated_calls_apart():
    torch.manual_seed(0)
    ops = _ops(SharedLayer(calls=3), torch.randn(2, 16))
    tree = call_tree(ops)
    layer_calls = [c for c in tree.calls.values() if c.path == "layer"]
    assert len(layer_calls) == 3 and len({(c.first, c.last) for c in layer_calls}) == 3
    assert [len(run) for run in tree.runs] == [3] and tree.num_blocks() == 3
    pen = tree.cut_penalties()
    assert [pen[c.first] for c in layer_calls] == [0.0, 0.0, 0.0]  # block boundaries are free
    inside = layer_calls[0].first + 1
    assert pen[inside] >= 1  # a cut inside a call splits it
