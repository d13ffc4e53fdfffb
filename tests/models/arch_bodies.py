"""Rank body, references and comparisons of the real-architecture matrix (``hf_archs.py``).

:func:`evaluate` is the whole matrix for one architecture: it computes the unsplit
model's references in this process, then spawns 2 gloo ranks ONCE; each rank traces the
model into 2 and 4 stages (``ps.pipeline(model, N)``, balanced) and runs every check on
those two pipes, each in its own process group with a short timeout, so that a check
that raises on one rank costs one timeout and never stops the others:

    split_2 / split_4   pipe(mb) == model(mb) (rank 0 checks N=2, rank 1 N=4)
    1F1B                1F1B on the 2-stage pipe, the model's own loss (labels=)
    ZBV                 ZBVZeroBubble on the 4-stage pipe (V: stages 0 and 3 on rank 0)
    ac_full             ZBV with activation_checkpoint="full" (and each stage runs forward + one
                        recompute per microbatch)
    ac_selective        1F1B with activation_checkpoint=<the arch's block patterns> (regions were
                        recomputed, none more than once)
    bf16                ZBV with mixed_precision=torch.bfloat16, against the unsplit model
                        under torch.autocast("cpu", torch.bfloat16)
    loss_count          ZBV, the per-item sum loss divided by the batch's valid items
    clip_2 / clip_inf   ps.clip_grad_norm_ after the ZBV step (2-norm, then inf-norm from
                        the same gradients) against torch.nn.utils.clip_grad_norm_

Each check gives an :class:`Outcome` (ok, the largest absolute error, a message); the
tests assert ``ok`` per check, ``benchmarks/real_archs.py`` prints the table.
Tolerances are those of ``tests/dist/test_training_kit.py``: fp32 loss and gradients
atol 1e-5; bf16 gradients atol 1e-5 + rtol 1e-4; clipped totals rel 1e-6, clipped
gradients atol 1e-6 + rtol 1e-5.
"""

from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import pippy_split as ps
from tests.models import hf_archs

CHECKS = ["split_2", "split_4", "1F1B", "ZBV", "ac_full", "ac_selective", "bf16", "loss_count", "clip_2",
          "clip_inf"]
WORLD = 2
CHECK_TIMEOUT_S = 30.0  # one check's blocking waits (a peer that raised costs this much, once)
CLIP_FRACTION = 0.3  # max_norm = this x the unsplit model's total norm: every gradient is scaled
INF = float("inf")


@dataclass
class Outcome:
    """One check of one architecture: passed, its largest absolute error (None: none measured), why not."""

    ok: bool
    err: float | None = None
    msg: str = ""
    headline: str = ""  # what raised, in one line (the root cause where a peer only timed out)

    def cell(self) -> str:
        """The table cell: ok / the error / the exception's last line."""
        if self.ok:
            return "ok" if self.err is None else f"ok {self.err:.1e}"
        if self.err is not None:
            return f"FAIL {self.err:.1e}"
        return "FAIL " + self.headline[:70]


# ---- the unsplit model -----------------------------------------------------------------


def _microbatches(arch: hf_archs.Arch) -> list[tuple[tuple, dict]]:
    return ps.split_args_kwargs(arch.args, arch.kwargs, hf_archs.N_MB)


def _targets(arch: hf_archs.Arch) -> list[torch.Tensor]:
    return list(_target(arch).chunk(hf_archs.N_MB))


def _target(arch: hf_archs.Arch) -> torch.Tensor:
    return arch.target if arch.target is not None else torch.zeros(hf_archs.BATCH)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def _reference(name: str, autocast: torch.dtype | None = None, per_item: bool = False) -> tuple[float, dict]:
    """Loss and gradients of the unsplit model on the whole batch: the mean over microbatches of
    its own loss, or (``per_item``) the sum loss over the batch's valid items. Under autocast
    with eager attention (see :func:`hf_archs.build`)."""
    arch = hf_archs.build(name, eager_attention=autocast is not None)
    total = 0.0
    count = float(hf_archs.count_fn(arch)(arch.target)) if per_item else None
    for (a, k), t in zip(_microbatches(arch), _targets(arch)):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = arch.model(*a, **k)
        loss = arch.sum_loss(out, t) / count if per_item else hf_archs.model_loss(out, t) / hf_archs.N_MB
        loss.backward()
        total += loss.item()
    return total, _grads(arch.model)


def _clip_reference(name: str, grads: dict[str, torch.Tensor], norm_type: float) -> tuple[float, float, dict]:
    """(max_norm, total, clipped gradients) of torch's clip_grad_norm_ on the unsplit model."""
    model = hf_archs.build(name).model
    params = dict(model.named_parameters(remove_duplicate=False))  # tied: both names, one tensor
    for n, g in grads.items():
        params[n].grad = g.clone()
    unique = [p for p in model.parameters() if p.grad is not None]  # tied weights once
    max_norm = CLIP_FRACTION * float(torch.nn.utils.get_total_norm([p.grad for p in unique], norm_type))
    total = torch.nn.utils.clip_grad_norm_(unique, max_norm, norm_type)
    return max_norm, float(total), _grads(model)


def references(name: str) -> dict[str, Any]:
    """Every reference the checks of ``name`` compare with."""
    arch = hf_archs.build(name)
    ref: dict[str, Any] = {"fp32": _reference(name), "bf16": _reference(name, torch.bfloat16)}
    if arch.sum_loss is not None:
        ref["loss_count"] = _reference(name, per_item=True)
    for key, norm_type in (("clip_2", 2.0), ("clip_inf", INF)):
        ref[key] = _clip_reference(name, ref["fp32"][1], norm_type)
    return ref


# ---- the rank body ---------------------------------------------------------------------


def _stage_grads(sched: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for st in sched.stages
            for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}


def _guarded(fn: Callable[[Any], dict]) -> dict:
    """``fn(group)`` in a fresh process group with a short timeout; an exception becomes ``{"error": text}``.
    ``"seconds"``: how long it took on this rank."""
    start = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CHECK_TIMEOUT_S))
    try:
        out = fn(group)
    except Exception:
        out = {"error": traceback.format_exc(limit=6)[-3000:]}
    out["seconds"] = time.perf_counter() - start
    return out


def _split_check(pipe: Any, arch: hf_archs.Arch, n: int) -> dict:
    if pipe.num_stages != n:
        return {"error": f"ps.pipeline(model, {n}) gave {pipe.num_stages} stages"}
    a, k = _microbatches(arch)[0]
    with torch.no_grad():
        got, want = pipe(*a, **k), arch.model(*a, **k)
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec:
        return {"error": f"output structure differs:\n  pipe  {got_spec}\n  model {want_spec}"}
    err, bad = 0.0, []
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(w, torch.Tensor):
            e = float((g.float() - w.float()).abs().max()) if w.numel() else 0.0
            err = max(err, e)
            if g.shape != w.shape or g.dtype != w.dtype or not torch.allclose(g, w, atol=1e-5, rtol=1e-5):
                bad.append(f"leaf {i} {tuple(w.shape)}: max abs err {e:.2e}")
        elif g != w:
            bad.append(f"leaf {i}: {g!r} != {w!r}")
    return {"err": err, "bad": bad}


def _step(arch: hf_archs.Arch, pipe: Any, schedule: str, group: Any, loss_fn: Callable = hf_archs.model_loss,
          before: Callable[[Any], None] | None = None, **options: Any) -> tuple[Any, dict]:
    """One step of a fresh schedule of ``pipe`` on the whole batch: (schedule, its loss and this rank's grads)."""
    arch.model.zero_grad(set_to_none=True)
    sched = ps.build_schedule(pipe, schedule, hf_archs.N_MB, loss_fn=loss_fn, group=group,
                              timeout=CHECK_TIMEOUT_S, **options)
    for st in sched.stages:
        st.module.zero_grad(set_to_none=True)
    if before is not None:
        before(sched)
    sched.step(*arch.args, target=_target(arch), **arch.kwargs)
    return sched, {"loss": float(sched.loss), "grads": _stage_grads(sched)}


def _ac_full(arch: hf_archs.Arch, pipe: Any, group: Any) -> dict:
    """ZBV with activation_checkpoint="full"; ``calls``: each stage module's forward calls (F + one recompute).
    The schedules of one pipe share its stage modules: the hooks go once the step is done."""
    calls: dict[int, int] = {}
    hooks = []

    def counting(sched: Any) -> None:
        for st in sched.stages:
            calls[st.stage_index] = 0

            def count(module, args, out, s=st.stage_index):
                calls[s] += 1

            hooks.append(st.module.register_forward_hook(count))

    try:
        out = _step(arch, pipe, "ZBVZeroBubble", group, activation_checkpoint="full", before=counting)[1]
    finally:
        for h in hooks:
            h.remove()
    return {**out, "calls": dict(calls)}


def _ac_selective(arch: hf_archs.Arch, pipe: Any, group: Any) -> dict:
    """1F1B with the arch's selective patterns; ``counts``: (region calls, recomputes) per stage."""
    sched, out = _step(arch, pipe, "1F1B", group, activation_checkpoint=arch.selective)
    return {**out, "counts": [st.region_counts for st in sched.stages]}


def _zbv_and_clip(arch: hf_archs.Arch, pipe: Any, group: Any, max_norms: dict[str, float]) -> dict:
    """The ZBV step, then clip_grad_norm_ (2, then inf from the same gradients) on its schedule."""
    sched, out = _step(arch, pipe, "ZBVZeroBubble", group)
    params = [p for st in sched.stages for p in st.module.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in params]
    for key, norm_type in (("clip_2", 2.0), ("clip_inf", INF)):
        for p, g in zip(params, saved):
            p.grad.copy_(g)
        try:
            total = ps.clip_grad_norm_(sched, max_norms[key], norm_type)
            out[key] = {"total": float(total), "grads": _stage_grads(sched)}
        except Exception:
            out[key] = {"error": traceback.format_exc(limit=6)[-3000:]}
    return out


def arch_rank(rank: int, world: int, name: str, max_norms: dict[str, float]) -> dict[str, dict]:
    """Every check of ``name`` on this rank: ``{check: {"loss", "grads", ...} | {"error": text}}``."""
    arch = hf_archs.build(name)
    mb = _microbatches(arch)[0]
    res: dict[str, dict] = {}
    pipes: dict[int, Any] = {}
    for n in (2, 4):
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():  # fewer blocks than 2 x N: the balance warning is expected
                warnings.filterwarnings("ignore", message=r"pipeline\(model, ", category=UserWarning)
                pipes[n] = ps.pipeline(arch.model, n, *mb)
        except Exception:
            res[f"split_{n}"] = {"error": traceback.format_exc(limit=6)[-3000:]}
        res[f"trace_{n}"] = {"seconds": time.perf_counter() - start}
    mine = (2, 4)[rank % 2]
    if mine in pipes:
        res[f"split_{mine}"] = _guarded(lambda g: _split_check(pipes[mine], arch, mine))
    if 2 in pipes:
        p2 = pipes[2]
        res["1F1B"] = _guarded(lambda g: _step(arch, p2, "1F1B", g)[1])
        res["ac_selective"] = _guarded(lambda g: _ac_selective(arch, p2, g))
    if 4 in pipes:
        p4 = pipes[4]
        zbv = _guarded(lambda g: _zbv_and_clip(arch, p4, g, max_norms))
        for key in ("clip_2", "clip_inf"):
            res[key] = zbv.pop(key, {"error": "the ZBV step raised:\n" + zbv.get("error", "")})
        res["ZBV"] = zbv
        res["ac_full"] = _guarded(lambda g: _ac_full(arch, p4, g))
        eager = hf_archs.build(name, eager_attention=True)  # the bf16 reference's attention kernel
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"pipeline\(model, ", category=UserWarning)
            p4_eager = ps.pipeline(eager.model, 4, *_microbatches(eager)[0])
        res["bf16"] = _guarded(lambda g: _step(eager, p4_eager, "ZBVZeroBubble", g,
                                               mixed_precision=torch.bfloat16)[1])
        count = hf_archs.count_fn(arch)
        if count is not None:
            res["loss_count"] = _guarded(lambda g: _step(arch, p4, "ZBVZeroBubble", g, loss_fn=arch.sum_loss,
                                                         loss_count=count)[1])
    return res


# ---- comparisons -----------------------------------------------------------------------


def _raised(results: list[dict]) -> Outcome | None:
    """The ranks' exceptions as a failed outcome (root causes first, a peer's timeout last), or None."""
    failed = [(r, res["error"]) for r, res in enumerate(results) if "error" in res]
    if not failed:
        return None
    failed.sort(key=lambda f: "PipelineTimeout" in f[1] or "Timed out" in f[1])
    last_lines = [line for line in failed[0][1].strip().splitlines() if line.strip()]
    return Outcome(False, None, "\n".join(f"rank {r}: {text}" for r, text in failed),
                   f"rank {failed[0][0]}: {last_lines[-1] if last_lines else ''}")


def _compare_grads(results: list[dict], ref: dict[str, torch.Tensor], atol: float, rtol: float,
                   key: str = "grads") -> tuple[float, list[str]]:
    """Largest absolute error over the union of the ranks' gradients, and what is wrong."""
    err, bad, seen = 0.0, [], set()
    for r in results:
        for fqn, g in r[key].items():
            seen.add(fqn)
            if fqn not in ref:
                bad.append(f"{fqn}: a gradient where the unsplit model has none")
                continue
            want = ref[fqn]
            e = float((g - want).abs().max())
            err = max(err, e)
            excess = float(((g - want).abs() - (atol + rtol * want.abs())).max())
            if excess > 0 or g.isnan().any():
                bad.append(f"{fqn}: max abs err {e:.2e}")
    missing = sorted(set(ref) - seen)
    if missing:
        bad.append(f"no rank gives a gradient for {len(missing)} parameter(s): {missing[:6]}")
    return err, bad


def _train_outcome(results: list[dict], ref: tuple[float, dict], atol: float, rtol: float) -> Outcome:
    failed = _raised(results)
    if failed is not None:
        return failed
    ref_loss, ref_grads = ref
    err, bad = _compare_grads(results, ref_grads, atol, rtol)
    for rank, r in enumerate(results):
        e = abs(r["loss"] - ref_loss)
        err = max(err, e)
        if not e < 1e-5:
            bad.insert(0, f"rank {rank}: loss {r['loss']:.7f} != {ref_loss:.7f} (err {e:.2e})")
        if "calls" in r and any(n != 2 * hf_archs.N_MB for n in r["calls"].values()):
            bad.insert(0, f"rank {rank}: stage forward calls {r['calls']}, not forward + one recompute per microbatch")
        # A region call that saved no tensor (views, masks) is never recomputed: at most once each.
        if "counts" in r and any(recomputes > calls for calls, recomputes in r["counts"]):
            bad.insert(0, f"rank {rank}: (region calls, recomputes) per stage {r['counts']}: recomputed more than once")
    if "counts" in results[0] and sum(recomputes for r in results for _, recomputes in r["counts"]) == 0:
        bad.insert(0, f"no region was recomputed: (region calls, recomputes) {[r['counts'] for r in results]}")
    return Outcome(not bad, err, "\n".join(bad[:12]))


def _clip_outcome(results: list[dict], ref: tuple[float, float, dict]) -> Outcome:
    failed = _raised(results)
    if failed is not None:
        return failed
    _, ref_total, ref_grads = ref
    err, bad = _compare_grads(results, ref_grads, 1e-6, 1e-5)
    for rank, r in enumerate(results):
        if abs(r["total"] - ref_total) > 1e-6 * abs(ref_total):
            bad.insert(0, f"rank {rank}: total norm {r['total']:.7g} != {ref_total:.7g} "
                          f"(rel err {abs(r['total'] - ref_total) / ref_total:.1e})")
    return Outcome(not bad, err, "\n".join(bad[:12]))


def _split_outcome(result: dict) -> Outcome:
    if "error" in result:
        return _raised([result]) or Outcome(False)
    return Outcome(not result["bad"], result["err"], "\n".join(result["bad"]))


def _not_run(results: list[dict[str, dict]]) -> Outcome:
    """A check that could not run: ps.pipeline() raised on every rank."""
    traced = [r[k] for r in results for k in ("split_2", "split_4") if "error" in r.get(k, {})]
    cause = _raised(traced[:1]) if traced else None
    return Outcome(False, None, "not run: ps.pipeline() raised\n" + (cause.msg if cause else ""),
                   "not run: " + (cause.headline if cause else "no rank ran it"))


def outcomes(results: list[dict[str, dict]], ref: dict[str, Any]) -> dict[str, Outcome]:
    """Each check's outcome from the ranks' results and the references."""
    out: dict[str, Outcome] = {}
    for n in (2, 4):
        done = [r[f"split_{n}"] for r in results if f"split_{n}" in r]
        out[f"split_{n}"] = _split_outcome(done[0]) if done else _not_run(results)
    for key, want, atol, rtol in (("1F1B", "fp32", 1e-5, 0.0), ("ZBV", "fp32", 1e-5, 0.0),
                                  ("ac_full", "fp32", 1e-5, 0.0), ("ac_selective", "fp32", 1e-5, 0.0),
                                  ("bf16", "bf16", 1e-5, 1e-4), ("loss_count", "loss_count", 1e-5, 0.0)):
        if want not in ref:
            continue  # no per-item loss: loss_count does not apply
        got = [r.get(key) for r in results]
        out[key] = _not_run(results) if None in got else _train_outcome(got, ref[want], atol, rtol)
    for key in ("clip_2", "clip_inf"):
        got = [r.get(key) for r in results]
        out[key] = _not_run(results) if None in got else _clip_outcome(got, ref[key])
    return out


def evaluate(name: str, timeout: float = 400.0) -> dict[str, Outcome]:
    """The whole matrix row of ``name``: references here, every check on 2 ranks spawned once."""
    from pippy_split.testing import run_ranks

    ref = references(name)
    max_norms = {key: ref[key][0] for key in ("clip_2", "clip_inf")}
    results = run_ranks(arch_rank, WORLD, name, max_norms, timeout=timeout)
    return outcomes(results, ref)
