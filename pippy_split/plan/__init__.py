"""The planner: which split, schedule, stages per rank, microbatches and activation
checkpointing to use under a per-rank memory budget, from measured costs.

Flow: trace and profile the model once (:mod:`pippy_split.split.profile`), price each
split (:mod:`.costs`), simulate every candidate (:mod:`.search`), run the stages of the
fastest candidates' splits and simulate those again with the measured times
(:mod:`.measure`), rank the ones that fit (:mod:`.report`). ``plan.best.build_schedule()``
builds the choice.

Example:
    >>> import pippy_split as ps
    >>> from pippy_split import zoo
    >>> entry = zoo.get("mlp_stack", d=8, n_layer=4); mb = entry.args[0][:2]  # 4 residual layers; batch 8
    >>> plan = ps.plan(entry.model, (mb,), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
    ...                global_batch=8, schedules=["1F1B"], microbatches=[4], balance=["flops"], measure=False)
    >>> print(plan)
    Plan: 2 of 2 candidates fit 1.00 GB per rank (2 ranks, batch 8)
    ...
    best: 1F1B x1/rank, split layers.2 (2 stages by flops, ...), m=4, AC=off: step ...
    run it in Python, on every rank:
        # example_args: one microbatch (2 samples) of the model's inputs
        pipe = ps.pipeline(model, ["layers.2"], example_args)
        sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=loss_fn, group=group)
    >>> sched = plan.best.build_schedule(group=group)  # on each of the 2 ranks  # doctest: +SKIP
"""

from .costs import CommModel, SplitCosts, StageCosts, parse_bytes
from .report import Candidate, Plan, PlanError
from .search import plan, predict_candidate

__all__ = ["plan", "predict_candidate", "Plan", "Candidate", "PlanError", "CommModel", "SplitCosts", "StageCosts",
           "parse_bytes"]
