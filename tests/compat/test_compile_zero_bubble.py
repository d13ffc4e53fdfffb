"""torch.compile under the compat zero-bubble schedules: the peer refuses a stage holding a
``torch.compile``'d module; here it runs, on purpose, with the unsplit model's gradients
(as ``pippy_split.compat``'s docstring says).

Pure tier: both stages in this process; the compile backend is eager (no code generation).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.pipelining.schedules as peer_schedules
import torch.nn.functional as F

from pippy_split import compat
from pippy_split.compat import schedules as S

from .bodies import N_MB, grads_of, make, reference


def _eager_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    return gm.forward


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_compiled_blocks_run_under_zero_bubble_with_the_models_gradients(name):
    model, x, target = make()
    _, ref_out, ref_grads = reference(model, x, target)
    pipe = compat.pipeline(model, (x.chunk(N_MB)[0],), split_spec={"layers.2": compat.SplitPoint.BEGINNING})
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in range(2)]
    for stage, block in ((stages[0], "1"), (stages[1], "3")):
        holder = stage.submod.get_submodule("layers")
        setattr(holder, block, torch.compile(getattr(holder, block), backend=_eager_backend))

    peer_check = getattr(peer_schedules, "_check_torch_compile_compatibility", None)
    if peer_check is not None:  # the peer's own check, as its zero-bubble constructors run it
        with pytest.raises(RuntimeError, match="torch.compile"):
            peer_check(stages, f"Schedule{name}")

    sched = S.get_schedule_class(name)(stages, N_MB, loss_fn=F.mse_loss)
    out = sched.step(x, target=target)

    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    grads = {k.replace("._orig_mod", ""): g for k, g in grads_of([st.submod for st in stages]).items()}
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, atol=1e-5, rtol=0)
