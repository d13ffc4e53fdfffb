"""A model built on ``meta`` whose non-persistent buffer (a rope cache) is computed by its
module's own ``init_states`` (torchtitan's module protocol): ``build_stage`` initialises it, and
``state_dict=`` may hold it. No torchtitan needed: the protocol is imitated."""

from __future__ import annotations

import torch

import pippy_split as ps


class Rope(torch.nn.Module):
    """Like torchtitan's RoPE: a non-persistent cache made in __init__ and again by init_states."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.n = n
        self.register_buffer("cache", self._compute(), persistent=False)

    def _compute(self) -> torch.Tensor:
        return torch.arange(self.n, dtype=torch.float32).cos()

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.cache.device):
            self.cache = self._compute()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cache


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Embedding(8, 16)
        self.rope = Rope()
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.rope(self.a(x)))


def _meta_pipe() -> ps.Pipe:
    with torch.device("meta"):
        model = Net()
    return ps.pipeline(model, ["rope"], (torch.randint(0, 8, (2, 3)),))  # tokens, as torchtitan's


def test_a_meta_stage_gets_its_rope_cache_from_the_owner_init_states():
    stage = _meta_pipe().build_stage(1, "cpu")
    torch.testing.assert_close(stage.module.get_buffer("rope.cache"), Rope().cache)


def test_state_dict_may_hold_non_persistent_buffers():
    torch.manual_seed(0)
    real = Net()
    full = {**real.state_dict(), "rope.cache": real.rope.cache * 2}
    pipe = _meta_pipe()
    stage = pipe.build_stage(1, "cpu", state_dict=full)
    torch.testing.assert_close(stage.module.get_buffer("rope.cache"), real.rope.cache * 2)
    torch.testing.assert_close(stage.module.get_parameter("b.weight"), real.b.weight)
