"""tests/torchtitan needs torchtitan (the ``pippy_split[torchtitan]`` extra, plus ``pip install
--no-deps triton==3.8.0`` on a CPU machine: torchtitan imports triton unconditionally); without
it every module here but ``test_meta_init.py`` is skipped with that reason."""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("torchtitan") is None:
    collect_ignore = ["bodies.py", "models.py", "test_trainer_sequence.py"]
