"""Adapters that let other training frameworks run on pippy_split.

Each submodule is one framework's extension point and imports nothing of that framework
unless its own name says so:

- :mod:`pippy_split.integrations.torchtitan`: ``pipeline_llm``, a ``pipelining_fn`` for a
  torchtitan ``ModelSpec`` (automatic balanced cuts, every schedule);
- :mod:`pippy_split.integrations.torchtitan_tensor_parallel`: TP on ``pipeline_llm``'s stages
  (a stage module's ``parallelize``; torchtitan's DTensor activations carried across the cuts);
- :mod:`pippy_split.integrations.torchtitan_compat`: torchtitan's own ``pipeline_llm`` run with
  :mod:`pippy_split.compat` in place of ``torch.distributed.pipelining`` (its FQN lists kept).
"""
