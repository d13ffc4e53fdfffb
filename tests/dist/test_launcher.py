"""A rank SIGKILLed under torch's elastic launcher: the others fail fast naming it,
and the launcher itself fails (non-zero), instead of the job hanging."""

from __future__ import annotations

import time

import pytest

from pippy_split.testing import free_port

from .bodies import launched_worker


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_sigkilled_rank_under_the_launcher(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=3, rdzv_backend="c10d",
                          rdzv_endpoint=f"localhost:{free_port()}", max_restarts=0, monitor_interval=0.5,
                          start_method="spawn", run_id="pippy-split-kill-test")
    start = time.monotonic()
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(config, launched_worker)(str(tmp_path))
    elapsed = time.monotonic() - start
    assert elapsed < 90  # far below the 60 s pipeline timeout plus start-up
    assert "Signal 9" in str(info.value) or "SIGKILL" in str(info.value)
    survivors = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    # Whoever noticed first names rank 1 (the launcher may stop the other before it does).
    assert survivors, "no surviving rank reported an error"
    assert any("rank 1" in text for text in survivors.values()), survivors
