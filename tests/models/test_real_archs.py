"""Real Hugging Face architectures through the whole kit, against the unsplit model (issue 20).

Nineteen architectures from tiny configs (``hf_archs.py``: decoder LMs incl. MoE, tied
embeddings, alibi, state-space; encoders; encoder-decoders; vision and vision-text),
nothing downloaded, eval mode. For each, 2 gloo ranks are spawned once
(``arch_bodies.evaluate``) and run every check on the pipes ``ps.pipeline(model, 2)``
and ``ps.pipeline(model, 4)`` traced there:

    split_2 / split_4   pipe(mb) equals model(mb), output leaf by leaf
    1F1B, ZBV           the model's own loss (labels=): loss and every gradient, atol 1e-5,
                        the ranks' gradients together = the unsplit model's
    ac_full             ZBVZeroBubble with activation_checkpoint="full"
    ac_selective        1F1B with activation_checkpoint=[the arch's block sub-modules]
    bf16                ZBVZeroBubble with mixed_precision=torch.bfloat16 against the unsplit
                        model under torch.autocast("cpu", torch.bfloat16): atol 1e-5 + rtol 1e-4
    loss_count          token- (or image-) normalised sum loss, ZBVZeroBubble
    clip_2 / clip_inf   ps.clip_grad_norm_ after the ZBV step (tied embedding and head both on
                        rank 0) against torch.nn.utils.clip_grad_norm_ on the unsplit model

One test per (architecture, check), so the matrix reads from the test ids
(``test_matches_the_unsplit_model[qwen3-bf16]``); ``python -m benchmarks.real_archs``
prints it as a table with the errors.
"""

from __future__ import annotations

import pytest

from tests.models import arch_bodies, hf_archs

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(hf_archs.BUILDERS))
def matrix(request) -> dict[str, arch_bodies.Outcome]:
    why = hf_archs.missing(request.param)
    if why is not None:
        pytest.skip(why)
    return arch_bodies.evaluate(request.param)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(420)  # the first check of an architecture also spawns its ranks (~5-25 s)
@pytest.mark.parametrize("check", arch_bodies.CHECKS)
def test_matches_the_unsplit_model(matrix, check):
    if check not in matrix:
        pytest.skip(f"{check} does not apply (no per-item loss)")
    outcome = matrix[check]
    assert outcome.ok, f"{check} (max abs err {outcome.err}):\n{outcome.msg}"
