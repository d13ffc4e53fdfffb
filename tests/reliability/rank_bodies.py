"""Rank bodies of the cross-rank reliability cases (top-level so they pickle)."""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo


def _outcome(fn):
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # returned, not raised: the failing rank stays alive, as in a notebook
        return (type(e).__name__, str(e))


def one_rank_fails_its_checks(rank: int, world: int):
    """kwargs_buffers on 3 ranks (1F1B): rank 0 alone splits the inputs (the ``mask`` kwarg
    travels from there to the last stage); it gets a mask of another batch size. Then a
    schedule without loss_fn (only rank 2, with the last stage, can tell); then a good step."""
    entry = zoo.get("kwargs_buffers")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0]
    pipe = ps.pipeline(entry.model, entry.split_spec, *mb)
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=entry.loss_fn, timeout=600)
    bad = dict(entry.kwargs, mask=entry.kwargs["mask"][:6]) if rank == 0 else entry.kwargs
    out = [_outcome(lambda: sched.step(*entry.args, target=entry.target, **bad))]
    no_loss = ps.build_schedule(pipe, "1F1B", 4, timeout=600)
    out.append(_outcome(lambda: no_loss.step(*entry.args, target=entry.target, **entry.kwargs)))
    out.append(_outcome(lambda: sched.step(*entry.args, target=entry.target, **entry.kwargs)))
    out.append(float(sched.loss))
    return out


def _mlp(width: int = 16, depth: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _raise_on_call(n: int):
    """A forward hook that raises on its ``n``-th call (0-based): a failure in the middle of a step."""
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1
        if calls[0] == n + 1:
            raise ValueError(f"a bad batch seen by the user's hook (call {n})")

    return hook


def fails_mid_step_and_lives_on(rank: int, world: int, failing: int, timeout: float, breaks_own: bool = True):
    """1F1B over ``world`` ranks, one stage each; rank ``failing`` raises in its stage's forward of
    microbatch 2 (a hook on the user's module), catches it, calls step() again, and stays alive
    (sleeping, up to 60 s, until every other rank has said it is done). Every other rank returns
    how long its step() took to raise, what it raised, and what its next step() raised.
    ``breaks_own=False``: the failing rank leaves its connections open, so the others learn of
    the failure from the store alone (the watcher), not from a connection closing."""
    import time

    import torch.distributed as dist

    model = _mlp(depth=2 * world)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe = ps.pipeline(model, [str(2 * k) for k in range(1, world)], (x[:2],))
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=torch.nn.functional.mse_loss, timeout=timeout)
    sched.step(x, target=y)  # a good step first: the failure comes once the pipeline runs
    if rank == failing:
        model[2 * rank].register_forward_hook(_raise_on_call(2))
        if not breaks_own:
            sched._runtime.p2p.abort = lambda: None  # type: ignore[method-assign]
    start = time.monotonic()
    first = _outcome(lambda: sched.step(x, target=y))
    took = time.monotonic() - start
    start = time.monotonic()
    again = _outcome(lambda: sched.step(x, target=y))
    again_took = time.monotonic() - start
    store = dist.distributed_c10d._get_default_store()
    if rank == failing:  # a notebook or a loop that skips the batch: the process lives on
        end = time.monotonic() + 60
        while time.monotonic() < end and not store.check([f"test/reported/{r}" for r in range(world) if r != rank]):
            time.sleep(0.2)
    else:
        store.set(f"test/reported/{rank}", "1")
    return first, took, again, again_took


def a_target_that_does_not_fit(rank: int, world: int):
    """2 ranks, 1F1B: every rank passes a target of 12 rows for 16 inputs (3 per microbatch
    against 4), then a good batch. The last stage's rank finds it before any message."""
    model = _mlp(depth=4)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    pipe = ps.pipeline(model, ["4"], (x[:4],))
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=torch.nn.functional.mse_loss, timeout=600)
    out = [_outcome(lambda: sched.step(x, target=y[:12]))]
    out.append(_outcome(lambda: sched.step(x, target=y)))
    out.append(float(sched.loss))
    return out


def a_bad_target_after_a_good_step(rank: int, world: int, agree_every_step: bool):
    """2 ranks, 1F1B: a good step, then a target of 12 rows for 16 inputs, then a good batch.
    After a step has run, a static-shape step starts without the agreement's all-reduce (unless
    ``agree_every_step``): the last stage's failed check then stops every rank through the
    failure channel, and the schedule stays stopped. Returns each call's outcome and how long the
    bad step took on this rank."""
    import time

    model = _mlp(depth=4)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    pipe = ps.pipeline(model, ["4"], (x[:4],))
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=torch.nn.functional.mse_loss, timeout=600)
    sched.agree_every_step = agree_every_step
    out = [_outcome(lambda: sched.step(x, target=y))]
    t0 = time.monotonic()
    out.append(_outcome(lambda: sched.step(x, target=y[:12])))
    out.append(time.monotonic() - t0)
    out.append(_outcome(lambda: sched.step(x, target=y)))
    return out
