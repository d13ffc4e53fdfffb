"""The planner: which split, schedule, stages per rank, microbatches and activation
checkpointing to use under a per-rank memory budget, from measured costs.

Flow: trace and profile the model once (:mod:`pippy_split.split.profile`), price each
split (:mod:`.costs`), simulate every candidate (:mod:`.search`), run the stages of the
fastest candidates' splits and simulate those again with the measured times
(:mod:`.measure`), rank the ones that fit (:mod:`.report`). ``plan.best.build_schedule()``
builds the choice.

Example:
    >>> plan = ps.plan(model, (mb,), num_ranks=4, memory_budget="2GB", loss_fn=loss,  # doctest: +SKIP
    ...                global_batch=64)
    >>> print(plan); sched = plan.best.build_schedule(group=group)  # doctest: +SKIP
"""

from .costs import CommModel, SplitCosts, StageCosts, parse_bytes
from .report import Candidate, Plan, PlanError
from .search import evaluate, plan

__all__ = ["plan", "evaluate", "Plan", "Candidate", "PlanError", "CommModel", "SplitCosts", "StageCosts",
           "parse_bytes"]
