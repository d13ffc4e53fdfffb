"""With cuts named before tracing, the trace keeps only the call signatures the stages need
(the outermost modules lying whole in a stage; export's cost grows with each one kept), and
every module a stage runs whole is still the user's own object, called (issue 31)."""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.split.module_calls import called_module_names


class Iterated(torch.nn.Module):
    """A Sequential its parent iterates over (never called whole), and a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        self.more = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.seq:
            x = torch.tanh(layer(x))
        for layer in self.more:
            x = layer(x)
        return x


def test_only_the_outermost_whole_modules_keep_their_signatures():
    entry = zoo.get("tiny_gpt")
    x = entry.args[0][:2]
    pipe = ps.pipeline(entry.model, entry.split_spec, (x,))
    kept = set(pipe._traced.module_signatures)  # noqa: SLF001  # what the trace kept, read in a test
    blocks = {n for n, _ in entry.model.named_children()}
    assert kept and all(k.count(".") <= 1 for k in kept), sorted(kept)  # blocks.K, never blocks.K.attn
    assert not any(k.startswith("blocks.0.") for k in kept)
    called = set().union(*(called_module_names(pipe.get_stage_module(i)) for i in range(pipe.num_stages)))
    assert "blocks.0.attn" in called  # runs in blocks.0's own forward, the user's object
    assert blocks  # the model has children
    torch.testing.assert_close(pipe(x), entry.model(x), atol=0, rtol=0)


def test_children_of_a_container_its_parent_iterates_over_are_called_in_the_stage():
    model = Iterated()
    x = torch.randn(2, 4)
    pipe = ps.pipeline(model, ["seq.2"], (x,))
    second = pipe.get_stage_module(1)
    assert second.get_submodule("seq.3") is model.seq[3]
    assert {"seq.2", "seq.3", "more.0", "more.1"} <= called_module_names(second)
    fired = []
    model.seq[3].register_forward_hook(lambda m, a, out: fired.append(out.shape))
    torch.testing.assert_close(pipe(x), model(x), atol=0, rtol=0)
    assert len(fired) == 2  # once by the pipe, once by the model


def test_the_trace_records_no_source_line_per_node_and_leaves_fx_config_as_it_was():
    """Recording a stack trace per node was about a third of export's time and nothing reads
    it; the switch is put back afterwards so the user's own fx tracing is unchanged."""
    import torch.fx.config as fx_config

    from pippy_split.split.trace import trace_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before = fx_config.do_not_emit_stack_traces
    traced = trace_model(model, (torch.randn(2, 4),))
    assert fx_config.do_not_emit_stack_traces == before
    ops = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert ops and not any(n.meta.get("stack_trace") for n in ops)
