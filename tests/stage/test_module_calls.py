"""A traced stage calls the user's own modules: every module call the cut does not enter
runs its own ``forward`` (one process; the distributed compositions are in tests/dist)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pippy_split as ps
from pippy_split import zoo


def _gpt():
    entry = zoo.get("tiny_gpt")
    x, y = entry.args[0], entry.target
    return entry, x, y


def _reference(entry, x, y, n_mb=4):
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        (entry.loss_fn(entry.model(xm), ym) / n_mb).backward()
    grads = {n: p.grad.clone() for n, p in entry.model.named_parameters()}
    entry.model.zero_grad(set_to_none=True)
    return grads


def _assert_grads(model, expected):
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=0, msg=n)


def test_stage_modules_hold_the_users_module_objects():
    entry, x, _ = _gpt()
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],))
    for i in range(4):
        assert pipe.get_stage_module(i).get_submodule(f"blocks.{i}") is entry.model.blocks[i]
    assert pipe.get_stage_module(0).get_submodule("tok_emb") is entry.model.tok_emb
    assert pipe.get_stage_module(3).get_submodule("head") is entry.model.head
    calls = [n for n in pipe.get_stage_module(1).graph.nodes if n.op == "call_module"]
    assert [str(n.target) for n in calls] == ["blocks.1"]
    torch.testing.assert_close(pipe(x[:2]), entry.model(x[:2]), atol=0, rtol=0)


def test_a_cut_inside_a_module_leaves_its_pieces_traced():
    entry, x, _ = _gpt()
    pipe = ps.pipeline(entry.model, {"blocks.1.mlp": ps.SplitPoint.BEGINNING}, (x[:2],))
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    assert first.get_submodule("blocks.1.attn") is entry.model.blocks[1].attn  # whole in stage 0
    assert second.get_submodule("blocks.1.mlp") is entry.model.blocks[1].mlp
    assert not any(n.op == "call_module" and str(n.target) == "blocks.1" for m in (first, second)
                   for n in m.graph.nodes)  # the cut enters blocks.1: it is glue in both stages
    torch.testing.assert_close(pipe(x[:2]), entry.model(x[:2]), atol=0, rtol=0)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"])
def test_a_forward_hook_on_a_block_fires_once_per_microbatch_and_gradients_stay_exact(schedule):
    entry, x, y = _gpt()
    expected = _reference(entry, x, y)
    split = entry.split_spec if schedule != "1F1B" else []
    pipe = ps.pipeline(entry.model, split[:1] if schedule in ("ZBVZeroBubble", "DualPipeV",
                                                              "InterleavedZeroBubble", "Interleaved1F1B") else split,
                       (x[:2],))
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=entry.loss_fn)
    fired = []
    last = sched.stages[-1].module.get_submodule("blocks.3")
    handle = last.register_forward_hook(lambda m, a, out: fired.append(out.shape))
    sched.step(x, target=y)
    handle.remove()
    assert len(fired) == 4, fired
    _assert_grads(entry.model, expected)


def test_torch_compile_of_one_block_compiles_it():
    torch._dynamo.reset()
    entry, x, y = _gpt()
    expected = _reference(entry, x, y)
    pipe = ps.pipeline(entry.model, ["blocks.2"], (x[:2],))
    sched = ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=entry.loss_fn)
    block = sched.stages[0].module.get_submodule("blocks.1")
    frames = []
    block.compile(backend=lambda gm, example: frames.append(gm) or gm.forward)
    sched.step(x, target=y)
    assert frames, "torch.compile of blocks.1 compiled nothing"
    _assert_grads(entry.model, expected)


def _saved_bytes(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_checkpoint_wrapper_on_the_blocks_before_tracing_cuts_saved_bytes():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    entry, x, y = _gpt()
    plain = ps.pipeline(entry.model, ["blocks.2"], (x[:2],))
    wrapped_model = zoo.get("tiny_gpt").model
    for i, blk in enumerate(wrapped_model.blocks):
        wrapped_model.blocks[i] = checkpoint_wrapper(blk)
    wrapped = ps.pipeline(wrapped_model, ["blocks.2"], (x[:2],))
    assert isinstance(wrapped.get_stage_module(0).get_submodule("blocks.1"), type(wrapped_model.blocks[1]))
    mb = x[:2]
    before = _saved_bytes(lambda: plain(mb))
    after = _saved_bytes(lambda: wrapped(mb))
    model_wrapped = _saved_bytes(lambda: wrapped_model(mb))
    assert after < 0.5 * before, (after, before)
    assert after == model_wrapped, (after, model_wrapped)
    torch.testing.assert_close(wrapped(mb), wrapped_model(mb), atol=0, rtol=0)


def test_peft_disable_adapter_changes_the_pipes_output_like_the_models():
    peft = pytest.importorskip("peft")
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    base = t.LlamaForCausalLM(cfg).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, 64, (2, 8))
    pipe = ps.pipeline(model, 2, (ids,))
    with_adapter = pipe(ids).logits
    torch.testing.assert_close(with_adapter, model(ids).logits, atol=1e-6, rtol=0)
    with model.disable_adapter():
        without = pipe(ids).logits
        torch.testing.assert_close(without, model(ids).logits, atol=1e-6, rtol=0)
    assert not torch.allclose(with_adapter, without, atol=1e-4)


class _Shared(nn.Module):
    """One layer called three times (ALBERT's sharing): every call is swapped in."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layer = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = torch.tanh(self.layer(h))
        return self.out(h)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_a_module_called_several_times_is_called_each_time(schedule):
    torch.manual_seed(0)
    model = _Shared()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        (loss(model(xm), ym) / 4).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe = ps.pipeline(model, ["out"] if schedule == "ZBVZeroBubble" else [], (x[:2],))
    calls = []
    model.layer.register_forward_hook(lambda m, a, o: calls.append(1))
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=loss)
    sched.step(x, target=y)
    assert len(calls) == 3 * 4
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=0, msg=n)
