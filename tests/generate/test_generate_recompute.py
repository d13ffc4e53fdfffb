"""A model that keeps no cache decodes by recomputation (``pippy_split/generate/recompute.py``):
a plain ``forward(tokens)`` language model, split in two, generates exactly what a greedy loop
over the unsplit model's full forward of the growing sequence chooses (sampled tokens too, from
the same ``(seed, row, step)`` draws), in one process, over one lane or two; prompts of unequal
length and a refilled slot are refused by name, and a forward that takes no token ids still is.
torchtitan's models, on 2 ranks: ``tests/torchtitan/test_trainer_sequence.py``."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split.generate import GenerateOptions, GenerationError
from pippy_split.generate.sampling import choose_tokens

VOCAB, N_NEW = 64, 6


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class NoCacheLM(torch.nn.Module):
    """A causal LM whose forward takes its tokens only: no cache, no mask, no positions."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.pos = torch.nn.Parameter(torch.randn(32, d) * 0.1)
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def full_forward_reference(model: torch.nn.Module, prompts: torch.Tensor, n_new: int,
                           opts: GenerateOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token chosen from the unsplit model's full forward over the growing sequence:
    greedy (``opts`` None) or as ``generate`` samples (``choose_tokens`` on the same rows and
    steps); returns (sequences, log-probabilities of the chosen tokens)."""
    seq, logprobs = prompts, []
    rows = list(range(prompts.shape[0]))
    with torch.no_grad():
        for step in range(n_new):
            logits = model(seq)[:, -1].float()
            if opts is None:
                token = logits.argmax(-1)
                logprob = torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
            else:
                token, logprob = choose_tokens(logits, rows, [step] * len(rows), opts)
            logprobs.append(logprob)
            seq = torch.cat([seq, token[:, None]], dim=1)
    return seq, torch.stack(logprobs, dim=1)


@pytest.fixture(scope="module")
def lm_pipe() -> tuple[torch.nn.Module, ps.Pipe]:
    torch.manual_seed(0)
    model = NoCacheLM().eval()
    return model, ps.pipeline(model, ["layers.2"], (torch.zeros(2, 5, dtype=torch.long),))


def _prompts() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))


@pytest.mark.timeout(300)
def test_greedy_equals_the_full_forward_of_the_growing_sequence(lm_pipe) -> None:
    model, pipe = lm_pipe
    ref, ref_logprobs = full_forward_reference(model, _prompts(), N_NEW)
    for lanes in (None, 2):
        out = pipe.generate(_prompts(), max_new_tokens=N_NEW, return_logprobs=True, lanes=lanes)
        assert torch.equal(out.sequences, ref), lanes
        torch.testing.assert_close(out.logprobs, ref_logprobs, atol=1e-5, rtol=0)
    program = pipe.derived["decode_program"]
    assert program.plans[0].kv == (0,) and program.plans[1].kv == ()  # the prefix stays on the embedding's stage


@pytest.mark.timeout(300)
def test_sampled_tokens_equal_the_same_draws_over_the_full_forward(lm_pipe) -> None:
    model, pipe = lm_pipe
    out = pipe.generate(_prompts(), max_new_tokens=N_NEW, do_sample=True, top_k=8, seed=5, return_logprobs=True)
    opts = GenerateOptions(max_new_tokens=N_NEW, do_sample=True, top_k=8, seed=5, pad_token_id=0,
                           return_logprobs=True)
    ref, ref_logprobs = full_forward_reference(model, _prompts(), N_NEW, opts)
    assert torch.equal(out.sequences, ref)
    torch.testing.assert_close(out.logprobs, ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_prompts_of_unequal_length_and_refilled_slots_are_refused(lm_pipe) -> None:
    _, pipe = lm_pipe
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(GenerationError, match="NoCacheLM keeps no cache and reads no attention mask.*prompts of one "
                                              "length"):
        pipe.generate(_prompts(), attention_mask=mask, max_new_tokens=2)
    with pytest.raises(GenerationError, match="slots=1 refills.*NoCacheLM decodes by recomputing"):
        pipe.generate(_prompts(), max_new_tokens=2, slots=1)


def test_a_forward_that_takes_no_token_ids_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    pipe = ps.pipeline(model, ["1"], (torch.randn(2, 4),))
    with pytest.raises(GenerationError, match="cannot be decoded by recomputing its prefix either: it holds no "
                                              r"torch.nn.Embedding.*or a causal LM without a cache"):
        pipe.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=2)
