"""What torch 2.14 and 2.15 added to the peer's API, through pippy_split.compat, every stage in
this process: microbatches already split (``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs``, of
unequal sizes too), ``step(finalize_gradients=False)``, the multi-stage runtime options,
``PipelineStage.register_forward_context`` and ``analyze_pipeline_activation_liveness``."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split import compat
from pippy_split.compat import schedules as S
from tests.dist import varlen_bodies as varlen

from .bodies import N_MB, grads_of, make, reference

ATOL = 1e-5


def close(a, b) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _stages(n_stages: int):
    model, x, target = make()
    cuts = {1: None, 2: {"layers.2": compat.SplitPoint.BEGINNING}}[n_stages]
    pipe = compat.pipeline(model, (x.chunk(N_MB)[0],), split_spec=cuts)
    return model, x, target, [pipe.build_stage(i, torch.device("cpu")) for i in range(n_stages)]


def _schedule(name: str, stages: list, n_mb: int = N_MB, **kwargs):
    cls = S.get_schedule_class(name)
    return cls(stages[0], n_mb, **kwargs) if issubclass(cls, S.PipelineScheduleSingle) else cls(stages, n_mb, **kwargs)


# ---- microbatches already split ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, n_stages", [("1F1B", 1), ("ZBVZeroBubble", 2)])
def test_presplit_step_and_eval_equal_the_whole_batch(name, n_stages):
    """step(arg_mbs=, target_mbs=): the whole batch's losses, merged output (a tensor, as the
    peer returns) and gradients; eval takes them too."""
    model, x, target, stages = _stages(n_stages)
    sched = _schedule(name, stages, loss_fn=F.mse_loss)
    ref_losses, ref_out, ref_grads = reference(model, x, target)
    arg_mbs = [(xm,) for xm in x.chunk(N_MB)]
    target_mbs = list(target.chunk(N_MB))
    losses: list = []
    out = sched.step(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=losses)
    assert isinstance(out, torch.Tensor)
    close(out, ref_out)
    for got, want in zip(losses, ref_losses):
        close(got, want)
    grads = grads_of([st.submod for st in stages])
    for k in ref_grads:
        close(grads[k], ref_grads[k])
    eval_losses: list = []
    close(sched.eval(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=eval_losses), ref_out)
    for got, want in zip(eval_losses, ref_losses):
        close(got, want)


@pytest.mark.timeout(60)
def test_presplit_keyword_inputs_become_microbatches():
    """kwarg_mbs: one dict per microbatch; the keyword reaches stage 1 per microbatch."""
    torch.manual_seed(0)
    from .bodies import WithKwargs

    model = WithKwargs()
    x, y, target = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    pipe = compat.pipeline(model, (x[:2],), {"y": y[:2]})
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in range(pipe.num_stages)]
    sched = S.ScheduleInterleaved1F1B(stages, 4, loss_fn=F.mse_loss)
    out = sched.step(arg_mbs=[(xm,) for xm in x.chunk(4)], kwarg_mbs=[{"y": ym} for ym in y.chunk(4)],
                     target_mbs=list(target.chunk(4)))
    close(out, model(x, y))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_name", ["tiny_gpt", "fan_out_skip"])
def test_presplit_microbatches_of_unequal_sizes(model_name):
    """Microbatches that differ in a dim the pipe was traced dynamic in (a sequence length, or
    the rows of each microbatch): the loss and gradients of the unsplit model on the same
    microbatches; outputs merged where they concatenate (rows), else one per microbatch."""
    model, mbs, tgts, loss_fn, split, example, dyn = varlen.case(model_name, 2)
    ref_loss, ref_grads = varlen.reference(model_name, 2)
    pipe = ps.pipeline(model, split, example, dynamic_shapes=dyn)
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in range(2)]
    sched = S.ScheduleInterleaved1F1B(stages, len(mbs), loss_fn=loss_fn)
    losses: list = []
    out = sched.step(arg_mbs=list(mbs), target_mbs=list(tgts), losses=losses)
    torch.testing.assert_close(sum(float(v) for v in losses) / len(mbs), ref_loss, atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for st in stages for n, p in st.module.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4)
    if model_name == "fan_out_skip":  # rows differ: concatenated as the peer merges
        assert isinstance(out, torch.Tensor) and out.shape[0] == sum(varlen.LENGTHS)
    else:  # sequence lengths differ: the peer's merge could not join them
        assert isinstance(out, ps.Microbatches) and [o.shape[1] for o in out] == varlen.LENGTHS


def test_presplit_misuse_is_refused_by_name():
    """Each refusal has the peer's type and the peer's words (2.15.0's ``_get_microbatch_inputs`` /
    ``_check_inputs``), so code matching on them keeps working; ours follow."""
    _, x, target, stages = _stages(1)
    sched = _schedule("GPipe", stages, loss_fn=F.mse_loss)
    mbs = [(xm,) for xm in x.chunk(N_MB)]
    with pytest.raises(ValueError, match="pass pre-split positional inputs through arg_mbs"):
        sched.step(x, arg_mbs=mbs)
    with pytest.raises(ValueError, match="Unexpected keyword arguments with pre-split inputs: a, y"):
        sched.step(y=x, a=x, kwarg_mbs=[{}] * N_MB)
    with pytest.raises(ValueError, match="pass pre-split targets through target_mbs"):
        sched.step(arg_mbs=mbs, target=target)
    with pytest.raises(ValueError, match="Expecting 4 arg_mbs but got 3"):
        sched.step(arg_mbs=mbs[:3])
    with pytest.raises(ValueError, match="Expecting 4 target_mbs but got 1"):
        sched.step(arg_mbs=mbs, target_mbs=[target])
    with pytest.raises(TypeError, match="arg_mbs must be a list but got a <class 'tuple'>"):
        sched.step(arg_mbs=tuple(mbs))
    with pytest.raises(TypeError, match="kwarg_mbs must be a list but got a <class 'dict'>"):
        sched.step(arg_mbs=mbs, kwarg_mbs={"y": x})
    with pytest.raises(TypeError, match=r"arg_mbs must be a list of tuples, but arg_mbs\[1\] is a <class 'torch.Tensor'>"):
        sched.step(arg_mbs=[mbs[0], mbs[1][0], *mbs[2:]])
    with pytest.raises(TypeError, match=r"kwarg_mbs must be a list of dicts, but kwarg_mbs\[0\] is a <class 'tuple'>"):
        sched.eval(kwarg_mbs=[()] * N_MB)
    with pytest.raises(ValueError, match="same keywords"):
        sched.eval(arg_mbs=mbs, kwarg_mbs=[{"a": 1}, {}, {}, {}])


# ---- finalize_gradients ------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, n_stages", [("GPipe", 1), ("Interleaved1F1B", 2)])
def test_finalize_gradients_false_then_true_accumulates_the_two_steps(name, n_stages):
    """step(finalize_gradients=False) then step(): the sum of the two steps' gradients, each the
    mean over its microbatches (the peer's meaning; without FSDP it changes nothing, as there)."""
    model, x, target, stages = _stages(n_stages)
    sched = _schedule(name, stages, loss_fn=F.mse_loss)
    x2, t2 = x.flip(0) * 2, target.roll(1, 0)
    _, _, grads_a = reference(model, x, target)
    _, _, grads_b = reference(model, x2, t2)
    sched.step(x, target=target, finalize_gradients=False)
    sched.step(x2, target=t2, finalize_gradients=True)
    grads = grads_of([st.submod for st in stages])
    for k in grads_a:
        close(grads[k], grads_a[k] + grads_b[k])


class _FakeFSDP(torch.nn.Module):
    """Stands in for an FSDP2 module: records what gradient sync it is set to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.sync: list[bool] = []

    def forward(self, x):
        return self.lin(x)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.sync.append(requires_gradient_sync)


@pytest.mark.timeout(60)
def test_finalize_gradients_false_keeps_fsdp_gradient_sync_off():
    """On an FSDP2 module the runtime turns sync on for the last backward of a step; with
    finalize_gradients=False it stays off for the whole step, and the module is left as it was."""
    from torch.distributed import fsdp

    class Fake(_FakeFSDP, fsdp.FSDPModule):  # isinstance(m, FSDPModule) holds; _FakeFSDP's methods win
        pass

    mod = _FakeFSDP()
    mod.__class__ = Fake  # as fully_shard does (FSDPModule.__new__ would build the plain class)
    stage = compat.PipelineStage(mod, 0, 1, torch.device("cpu"))
    sched = S.ScheduleGPipe(stage, 2, loss_fn=F.mse_loss)
    x = torch.randn(4, 8)
    sched.step(x, target=x)
    assert mod.sync[-1] is True  # a plain step reduces on its last backward
    mod.sync.clear()
    sched.step(x, target=x, finalize_gradients=False)
    assert mod.sync and not any(mod.sync)
    assert "set_requires_gradient_sync" not in vars(mod)


# ---- the multi-stage runtime options -----------------------------------------------------------


def test_runtime_options_are_checked_and_warn_where_not_driven():
    _, _, _, stages = _stages(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        S.ScheduleZBVZeroBubble(stages, N_MB, max_active_stages=2, unshard_lookahead=(1,), defer_reduce_grad_wait=True)
        S.ScheduleInterleaved1F1B(stages, N_MB, None, None, None, None, True, True, False, 3, "auto")
    with pytest.warns(UserWarning, match="max_outstanding_sends=2.*not enforced"):
        S.ScheduleDualPipeV(stages, N_MB, max_outstanding_sends=2)
    for bad, match in [({"max_active_stages": 0}, "max_active_stages"), ({"unshard_lookahead": (1, 1)}, "tuple of 1"),
                       ({"unshard_lookahead": "some"}, "unshard_lookahead"), ({"max_outstanding_sends": -1}, "non-neg")]:
        with pytest.raises(ValueError, match=match):
            S.ScheduleLoopedBFS(stages, N_MB, **bad)


def test_register_custom_function_is_refused_saying_what_works():
    _, _, _, stages = _stages(2)
    with pytest.raises(NotImplementedError, match="register_forward_context.*dw_builder.*ScheduleFromOrder"):
        S.ScheduleZBVZeroBubble(stages, N_MB).register_custom_function("F", lambda *a: None)


# ---- register_forward_context, PipelineStageInfo -----------------------------------------------


@pytest.mark.timeout(60)
def test_forward_context_is_entered_around_every_forward():
    _, x, target, stages = _stages(2)
    seen: list = []

    @contextlib.contextmanager
    def context(info):
        seen.append((info.stage_index, info.microbatch_index, info.is_metadata_inference, torch.is_grad_enabled()))
        yield

    handle = stages[1].register_forward_context(context)
    with pytest.raises(RuntimeError, match="already registered"):
        stages[1].register_forward_context(context)
    sched = S.ScheduleInterleaved1F1B(stages, N_MB, loss_fn=F.mse_loss)
    sched.step(x, target=target)
    assert seen == [(1, mb, False, True) for mb in range(N_MB)]
    handle.remove()
    sched.step(x, target=target)
    assert len(seen) == N_MB
    assert compat.PipelineStageInfo(stage_index=1, microbatch_index=2).is_metadata_inference is False
    with pytest.raises(TypeError):
        compat.PipelineStageInfo(1, 2)  # keyword-only, as the peer's


# ---- activation liveness -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("granularity", ["stage_microbatch", "microbatch"])
def test_activation_liveness_slots_never_overlap_and_are_fewest(name, granularity):
    _, _, _, stages = _stages(2)
    sched = _schedule(name, stages)
    plan = compat.analyze_pipeline_activation_liveness(sched, pp_rank=0, stage_indices=[0, 1],
                                                       granularity=granularity)
    keys = [(s, mb) for s in (0, 1) for mb in range(N_MB)]
    assert sorted(plan.slot_by_stage_and_microbatch) == keys and plan.num_microbatches == N_MB
    lives = {k: plan.get_activation_lifetime(*k) for k in keys}
    for a in keys:
        for b in keys:
            overlap = lives[a][0] <= lives[b][1] and lives[b][0] <= lives[a][1]
            if a != b and overlap and lives[a] != lives[b]:
                assert plan.slot_for(*a) != plan.slot_for(*b), (a, b)
    points = {p for lo, hi in lives.values() for p in (lo, hi)}
    most = max(len({lives[k] for k in keys if lives[k][0] <= p <= lives[k][1]}) for p in points)
    assert plan.num_slots == most  # as many slots as lifetimes alive at once, no more
    with pytest.raises(ValueError, match="not analysed"):
        plan.slot_for(0, N_MB)
    with pytest.raises(ValueError, match="granularity"):
        compat.analyze_pipeline_activation_liveness(sched, pp_rank=0, stage_indices=[0], granularity="stage")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_finalize_gradients_false_defers_fsdp2_reduction_and_accumulates():
    """Real FSDP2 on two gloo ranks: after step(finalize_gradients=False) no gradient is reduced
    yet; the next step reduces the sum, equal to two separately reduced steps added up."""
    from pippy_split.testing import run_ranks

    from . import newer_bodies

    for r in run_ranks(newer_bodies.finalize_gradients_fsdp, 2, timeout=110):
        assert r["deferred"]
        assert r["max_diff"] < 1e-6
