"""``pipeline(model, N)`` on real architectures: balanced, and equal to the model.

Pure tier (no process group). Hugging Face models come from tiny configs (``hf.py``,
nothing downloaded); the torchvision architectures are rebuilt at small widths with
the same module structure (``vision.py``), because torchvision's wheel cannot load its
compiled ops against the CPU torch (``test_torchvision_itself`` says so when skipped).

For each model and N in (2, 4): the costliest stage costs at most ``TARGET_RATIO`` x an
even stage (total FLOPs / N) when the model has at least 2N repeated blocks, and
otherwise a warning names the best ratio; ``pipe(x)`` equals ``model(x)`` leaf by leaf.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.split.balance import TARGET_RATIO
from tests.models import hf, vision
from torch.utils import _pytree as pytree

from tests.split.helpers import assert_same_outputs, assert_state_dict_partition

pytest.importorskip("transformers")

MODELS = {**{name: hf.build for name in hf.BUILDERS}, **{name: vision.build for name in vision.BUILDERS}}
# Where the backward is compared too (one of each kind: decoder LM, shared layer, conv net, windows).
GRAD_CHECKED = {"llama", "albert", "resnet18", "swin_t"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request):
    name = request.param
    model, args, kwargs, blocks = MODELS[name](name)
    return name, model, args, kwargs, blocks


def _grads(model: torch.nn.Module, fn) -> dict[str, torch.Tensor | None]:
    """Gradients of the mean of every float output leaf (a mean, not a sum: a sum over
    4096 logits makes fp32 noise exceed any fixed tolerance, in the model as in the pipe)."""
    model.zero_grad(set_to_none=True)
    leaves = [t for t in pytree.tree_leaves(fn()) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.stack([t.float().mean() for t in leaves]).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _pipeline(model, n, args, kwargs, **kw) -> tuple[ps.Pipe, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ps.pipeline(model, n, args, kwargs, **kw)
    return pipe, [str(w.message) for w in caught if str(w.message).startswith("pipeline(model,")]


def _assert_balanced(pipe: ps.Pipe, n: int, blocks: int, warned: list[str]) -> None:
    report = pipe.balance
    shares = [f"{s:.0%}" for s in report.shares]
    if blocks >= 2 * n:
        assert report.ratio <= TARGET_RATIO, f"{blocks} blocks into {n} stages: shares {shares}"
        assert not warned, warned
    else:
        assert report.ratio <= TARGET_RATIO or any(f"{report.ratio:.2f}x" in w for w in warned), (shares, warned)


@pytest.mark.parametrize("n", [2, 4])
def test_int_split_is_balanced_and_equal_to_the_model(built, n):
    name, model, args, kwargs, blocks = built
    pipe, warned = _pipeline(model, n, args, kwargs)
    assert pipe.num_stages == n
    assert pipe.balance.metric == "flops"
    _assert_balanced(pipe, n, blocks, warned)
    # The report counts what the stages hold: the same FLOPs the stage table shows.
    torch.testing.assert_close([float(st.flops) for st in pipe.stages], list(pipe.balance.stage_costs))
    assert_same_outputs(pipe(*args, **kwargs), model(*args, **kwargs))
    assert_state_dict_partition(pipe, model)
    if name in GRAD_CHECKED and n == 4:
        want = _grads(model, lambda: model(*args, **kwargs))
        got = _grads(model, lambda: pipe(*args, **kwargs))
        assert got.keys() == want.keys()
        for key, w in want.items():
            if w is None:
                assert got[key] is None, key
            else:
                torch.testing.assert_close(got[key], w, atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("balance", ["params", "memory", "time"])
@pytest.mark.parametrize("name", ["llama", "albert", "resnet18", "vit_b_16"])
def test_other_cost_models_balance_too(name, balance):
    model, args, kwargs, blocks = MODELS[name](name)
    pipe, warned = _pipeline(model, 4, args, kwargs, balance=balance)
    assert pipe.balance.metric == balance and pipe.num_stages == 4
    # Blocks repeat in parameters only where they are the same size: not ResNet's (layer4's
    # four convolutions hold 75% of the weights) nor ALBERT's (one shared set of weights).
    # Measured on CPU, layer4's convolutions on 1x1 maps are slow too (a third of the time).
    uneven = name == "resnet18" or (name, balance) == ("albert", "params")
    _assert_balanced(pipe, 4, 0 if uneven else blocks, warned)
    assert_same_outputs(pipe(*args, **kwargs), model(*args, **kwargs))


@pytest.mark.parametrize("name", ["tiny_gpt", "tied_lm", "tiny_llama", "mlp_stack"])
def test_zoo_with_eight_blocks(name):
    e = zoo.get(name, n_layer=8)
    for n in (2, 4):
        pipe, warned = _pipeline(e.model, n, e.args, e.kwargs)
        _assert_balanced(pipe, n, 8, warned)
        assert_same_outputs(pipe(*e.args, **e.kwargs), e.model(*e.args, **e.kwargs))


def test_torchvision_itself():
    """torchvision's own models, where its wheel works with this torch (not on the CPU build)."""
    try:
        import torchvision.models as tvm
    except Exception as e:  # ImportError, or RuntimeError "operator torchvision::nms does not exist"
        pytest.skip(f"torchvision does not load here ({type(e).__name__}: {e}): its wheel for torch 2.13 "
                    f"(0.28.0) is a CUDA build whose compiled ops need libc10_cuda.so, absent from torch "
                    f"{torch.__version__}; tests/models/vision.py covers the same structures")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    for model in (tvm.resnet18(), tvm.vit_b_16(image_size=32), tvm.efficientnet_b0(), tvm.mobilenet_v3_small()):
        model.eval()
        pipe, warned = _pipeline(model, 4, (x,), {})
        assert pipe.balance.ratio <= TARGET_RATIO or warned
        assert_same_outputs(pipe(x), model(x))
