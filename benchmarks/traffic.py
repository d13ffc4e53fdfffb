"""Bytes and messages per step per rank, ours and the peer's, against the analytical minimum.

Issue items 5 and 7. Run alone with ``python -m benchmarks.traffic [--mode quick]``. In each
rank process every ``torch.distributed`` isend/irecv/send/recv is wrapped and counted
(``common.count_p2p``) over several training steps after a warm-up step (which, for
the peer, also does its shape inference). The minimum comes from ``pipe.edges``: each
edge between stages on different ranks moves once per microbatch forward and, if it
carries a gradient, once backward; stages on the same rank exchange nothing. Ours also
sends the step's loss (4 bytes) from the last stage's rank to every other rank, which is
what ``sched.loss`` on every rank costs (the peer keeps it on the last stage); the minimum
counts it for ours.

Cases:
    fan_out_skip   3 stages on 3 ranks, 1F1B: stage 0's output goes to stages 1 and 2.
    tiny_unet_v    the U-Net (skips 0->2, 0->3) on 2 ranks with ZBVZeroBubble (V placement).
    gpt_v          tiny GPT d=32, 4 stages, ZBVZeroBubble: a V schedule both tools can run.
    llama_grad     tiny Llama, 2 stages, 1F1B, positions made inside the model (the peer
                   cannot take a model input read by a later stage): the rotary table
                   (complex64) and the positions (int64) cross the cut without gradients.
    float_table    2 stages, 1F1B: a float32 table (a buffer, no gradient) looked up by
                   position in stage 0 and read in stage 1, as a real-valued rotary table is.
    tiny_llama     the zoo model as is (positions a model input read by stage 1); ours only.

In the 2-stage 1F1B cases rank 1 sends nothing but gradients, so its sent bytes are the
backward bytes, and what exceeds the gradients the edges need went to no-grad edges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pippy_split import zoo
from pippy_split.testing import RankFailure, run_ranks

from . import common

__all__ = ["Case", "cases", "run", "measure", "FloatTable", "SelfPositions"]

PEER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    """One traffic measurement: a model, a schedule, a number of ranks."""

    name: str
    schedule: str
    world: int
    n_mb: int
    peer: bool = True  # also try the peer (it may fail; the failure is recorded)


def cases(mode: str = "full") -> list[Case]:
    """full: every case; quick: all but gpt_v; smoke: fan_out_skip only."""
    if mode == "smoke":
        return [Case("fan_out_skip", "1F1B", 3, 4)]
    out = [Case("fan_out_skip", "1F1B", 3, 4), Case("tiny_unet_v", "ZBVZeroBubble", 2, 4),
           Case("llama_grad", "1F1B", 2, 4), Case("float_table", "1F1B", 2, 4),
           Case("tiny_llama", "1F1B", 2, 4, peer=False)]
    if mode == "full":
        out.insert(2, Case("gpt_v", "ZBVZeroBubble", 2, 8))
    return out


class _Mix(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.fc(h * table)  # (B, T, d)


class FloatTable(torch.nn.Module):
    """A real-valued rotary-style table looked up by positions in stage 0 and read in stage 1.

    forward(x (B, T, d)) -> (B, T, d). Split at "mix": the table rows (float32, a buffer,
    no gradient) cross the cut beside the activation h.
    """

    def __init__(self, d: int = 32, n_pos: int = 64) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.register_buffer("table", torch.linspace(0.5, 1.5, n_pos * d).reshape(n_pos, d))
        self.mix = _Mix(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device).repeat(B, 1)  # (B, T)
        return self.mix(torch.tanh(self.inp(x)), self.table[positions])


class SelfPositions(torch.nn.Module):
    """TinyLlama with positions made from the token shape: forward(tokens (B, T)) -> (B, T, V)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).repeat(B, 1)  # (B, T) int64, contiguous for gloo
        return self.m(tokens, positions)


def _entry(name: str) -> zoo.ZooEntry:
    if name == "fan_out_skip":
        return zoo.get("fan_out_skip")
    if name == "tiny_unet_v":
        return zoo.get("tiny_unet")
    if name == "gpt_v":
        return common.gpt(d=32, num_stages=4)
    if name == "float_table":
        torch.manual_seed(0)
        x, y = torch.randn(8, 32, 32), torch.randn(8, 32, 32)  # (B, T, d)
        return zoo.ZooEntry(FloatTable(), (x,), {}, ["mix"], 2, torch.nn.functional.mse_loss, y,
                            "float no-grad table crossing the cut")
    if name == "tiny_llama":
        return zoo.get("tiny_llama", num_stages=2)
    if name == "llama_grad":
        e = zoo.get("tiny_llama", num_stages=2)
        return zoo.ZooEntry(SelfPositions(e.model), (e.args[0],), {}, [f"m.{f}" for f in e.split_spec], 2,
                            e.loss_fn, e.target, "tiny Llama, positions made inside")
    raise KeyError(name)


def _body(rank: int, world: int, case: Case, tool: str, reps: int) -> dict:
    entry = _entry(case.name)
    if tool == "ours":
        runner = common.build_ours(entry, case.schedule, case.n_mb)
    else:
        runner = common.build_peer(entry, case.schedule, case.n_mb, rank, world)
    runner.step()  # warm-up (the peer infers shapes here)
    steps = []
    for _ in range(reps):
        with common.count_p2p() as c:
            runner.step()
        steps.append(c.as_dict())
    out = {"steps": steps, "note": runner.note}
    if tool == "ours":
        pipe = runner.pipe
        out["expected"] = common.expected_traffic(pipe, runner.sched.placement, case.n_mb, world,
                                                  shared_loss=True)[rank]
        out["edges"] = [str(e) for e in pipe.edges]
        # Backward bytes that edges without a gradient would cost, if they carried one.
        placement = runner.sched.placement
        out["nograd_edge_bytes_per_mb"] = sum(
            _edge_bytes(e) for e in pipe.edges
            if not e.spec.carries_grad and not e.from_input and placement[e.sender_stage] != placement[e.dst_stage])
    return out


def _edge_bytes(e) -> int:
    n = 1
    for d in e.spec.shape:
        n *= int(d)
    return n * torch.empty((), dtype=e.spec.dtype).element_size()


_KEYS = ("sent_bytes", "sent_msgs", "recv_bytes", "recv_msgs")


def _per_rank(results: list[dict]) -> list[dict]:
    """Per rank: median/min/max over steps of each count, and collectives."""
    rows = []
    for r in results:
        row = {k: common.summarize([s[k] for s in r["steps"]]) for k in _KEYS}
        row["collectives"] = common.summarize([s["collectives"] for s in r["steps"]])
        row["constant"] = all(s == r["steps"][0] for s in r["steps"])
        rows.append(row)
    return rows


def _failure(e: Exception) -> str:
    """The first line naming the root cause from a RankFailure (the first failing rank)."""
    failures = getattr(e, "failures", None) or {}
    text = next(iter(failures.values()), str(e))
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:300]
    return (lines[-1] if lines else str(e))[:300]


def measure(case: Case, reps: int = 5) -> dict:
    ours = run_ranks(_body, case.world, case, "ours", reps, timeout=300)
    row: dict = {"case": asdict(case), "edges": ours[0]["edges"], "reps": reps,
                 "expected": [r["expected"] for r in ours], "ours": _per_rank(ours)}
    row["ours_equals_minimum"] = all(
        row["ours"][k][key]["median"] == row["expected"][k][key] and row["ours"][k]["constant"]
        for k in range(case.world) for key in _KEYS)
    row["ours_collectives_per_step"] = [r["collectives"]["median"] for r in row["ours"]]
    nograd = ours[0]["nograd_edge_bytes_per_mb"] * case.n_mb
    row["nograd_edge_bytes"] = nograd
    if case.peer:
        try:
            peer = run_ranks(_body, case.world, case, "peer", reps, timeout=PEER_TIMEOUT_S)
            row["peer"] = _per_rank(peer)
            row["peer_note"] = peer[0]["note"]
        except RankFailure as e:
            row["peer"] = None
            row["peer_error"] = _failure(e)
    else:
        row["peer"] = None
        row["peer_error"] = ("a model input read by a later stage (not run here; the peer rejects it: "
                             "'_retrieve_recv_activations expected non-root _RecvInfo but got root arg')")
    if case.world == 2 and case.schedule == "1F1B":
        # 2 stages on 2 ranks: everything rank 1 sends is a gradient.
        need = row["expected"][1]["sent_bytes"]
        row["grad"] = {"needed_bytes": need, "ours_bytes": row["ours"][1]["sent_bytes"]["median"],
                       "ours_nograd_edge_bytes": row["ours"][1]["sent_bytes"]["median"] - need}
        if row.get("peer"):
            row["grad"]["peer_bytes"] = row["peer"][1]["sent_bytes"]["median"]
            row["grad"]["peer_nograd_edge_bytes"] = row["peer"][1]["sent_bytes"]["median"] - need
    return row


def run(mode: str = "full", reps: int = 5) -> dict:
    return {"rows": [measure(c, reps) for c in cases(mode)]}


def _report(row: dict) -> None:
    print(row["case"]["name"], "ours == minimum:", row["ours_equals_minimum"],
          "peer:", "ran" if row.get("peer") else row.get("peer_error"))


def main(argv: list[str] | None = None) -> dict:
    return common.item_main(__doc__, run, _report, argv)


if __name__ == "__main__":
    main()
