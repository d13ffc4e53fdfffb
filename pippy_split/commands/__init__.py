"""What each ``pippy-split`` command does, one module a command: ``simulate``, ``inspect``, ``plot``.

Where this sits: under :mod:`pippy_split.cli`, which parses the command line (without importing
torch, so ``--help`` answers at once) and imports the module of the command it runs. ``train``
and ``generate`` live with the job they run (:mod:`pippy_split.train`,
:mod:`pippy_split.training.generate_run`); ``plan`` with the planner's command line in
:mod:`pippy_split.cli`.
"""
