"""The cluster a job is planned for, as numbers (:class:`Cluster`), and a few presets.

Sits before :mod:`.costs` (which prices a layout on these numbers, with the kernels'
efficiencies of :mod:`.kernels`) and :mod:`.search` (``ps.plan_cluster``). No GPU is
touched: a cluster here is what its datasheet and network say. Memory is in the units
PyTorch reports (``torch.cuda.get_device_properties(0).total_memory``): an "80 GB" H100
exposes 79.11 GiB, not 80e9 bytes.

Example:
    >>> c = Cluster.preset("h100-sxm", gpus=512)
    >>> c.nodes, c.gpus_per_node
    (64, 8)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["Cluster", "PRESETS", "GiB"]

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous GPU cluster: ``gpus`` devices, ``gpus_per_node`` to a node."""

    gpus: int
    """Devices in the job."""
    gpus_per_node: int = 8
    """Devices sharing the fast intra-node fabric (NVLink); a group larger than this crosses nodes."""
    flops: float = 989e12
    """Peak dense matmul FLOP/s of one device in the training dtype (H100 SXM bf16: 989e12)."""
    fp8_flops: float = 0.0
    """Peak dense Float8 matmul FLOP/s of one device (H100 SXM: 1979e12; 0: none), used for
    the blocks' projections when the runtime trains them in Float8."""
    hbm_bytes: float = 79.11 * GiB
    """Device memory in bytes as PyTorch reports it (``total_memory``: H100 80 GB HBM3 79.11 GiB)."""
    hbm_bw: float = 3.35e12
    """Device memory bandwidth, bytes/s (the roofline's slope)."""
    intra_node_bw: float = 450e9
    """Bytes/s one device sends to the others of its node (NVLink, one direction)."""
    inter_node_bw: float = 50e9
    """Bytes/s one device sends across nodes (400 Gb/s NIC per GPU = 50e9)."""
    p2p_latency: float = 0.0
    """Seconds a point-to-point message costs besides its bytes / bandwidth (the network's
    and the communication library's fixed cost per message)."""
    action_overhead: float = 0.0
    """Seconds of host work each pipeline action (F, B, I or W of one microbatch on one
    stage) costs besides its ops: the runtime's bookkeeping and the launch of its ops,
    where the device does not hide them (0: hidden, as on a GPU kept busy)."""
    clock_fraction: float = 1.0
    """The fraction of the datasheet clock the tensor cores sustain under the job's power
    limit (1.0 at the rated TDP; torchtitan's Grand Teton H100s ran capped at 500 W of 700)."""
    efficiency: float | None = None
    """``None``: each op at the efficiency :mod:`.kernels` gives its shape (matmuls by their
    dimensions, attention, memory-bound ops at the HBM bandwidth). A number: every op at that
    flat fraction of ``flops`` (a machine whose rate was measured at the model's own shapes,
    as ``benchmarks.cluster_model_check`` does); communication runs at the stated bandwidths."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Cluster needs gpus >= 1 and gpus_per_node >= 1, got {self.gpus}, {self.gpus_per_node}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"Cluster: {self.gpus} gpus is not a whole number of {self.gpus_per_node}-GPU nodes")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ValueError(f"Cluster: efficiency must be in (0, 1], got {self.efficiency}")
        if self.p2p_latency < 0 or self.action_overhead < 0:
            raise ValueError(f"Cluster: p2p_latency and action_overhead must be >= 0 seconds, got "
                             f"{self.p2p_latency}, {self.action_overhead}")

    @property
    def nodes(self) -> int:
        """Nodes in the job."""
        return max(1, self.gpus // self.gpus_per_node)

    def bandwidth(self, group_span: int) -> float:
        """Bytes/s of a collective over a group whose members lie ``group_span`` ranks apart at
        most (ranks are numbered node by node): inside a node or across nodes."""
        return self.intra_node_bw if group_span <= self.gpus_per_node else self.inter_node_bw

    @property
    def dense_flops(self) -> float:
        """Sustained bf16 peak: the datasheet's ``flops`` at the power limit's clock."""
        return self.flops * self.clock_fraction

    def collective_bandwidth(self, members: int, stride: int = 1) -> float:
        """Bytes/s per GPU of a ring collective (all-gather, reduce-scatter) over ``members``
        ranks ``stride`` apart: inside a node the NVLink rate; across nodes each node's share
        crosses on the NICs of its members (NCCL runs one ring per NIC), so ``k`` members on a
        node move ``k`` NICs' worth, capped by NVLink.

        Example:
            >>> c = Cluster(gpus=64)
            >>> c.collective_bandwidth(8), c.collective_bandwidth(64), c.collective_bandwidth(8, stride=8)
            (450000000000.0, 400000000000.0, 50000000000.0)
        """
        if members * stride <= self.gpus_per_node:
            return self.intra_node_bw
        per_node = max(1, self.gpus_per_node // stride) if stride < self.gpus_per_node else 1
        return min(self.intra_node_bw, min(per_node, members) * self.inter_node_bw)

    def with_(self, **changes: float | None) -> Cluster:
        """A copy with some numbers changed, e.g. ``cluster.with_(efficiency=0.4)``."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def preset(cls, name: str, *, gpus: int | None = None, **changes: float) -> Cluster:
        """A named cluster: ``"h100-sxm"``, ``"h100-96gb"`` (torchtitan's Grand Teton: HBM2e,
        500 W), ``"a100-80gb"``; or ``"h100x512"`` (a preset's short name times a GPU count).

        Example:
            >>> Cluster.preset("h100x512").gpus, Cluster.preset("a100-80gb", gpus=64).flops
            (512, 312000000000000.0)
        """
        match = re.fullmatch(r"([a-z0-9-]+?)x(\d+)", name.lower())
        key = name.lower()
        if match and match.group(1) in _SHORT:
            key, gpus = _SHORT[match.group(1)], int(match.group(2))
        if key not in PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; known: {', '.join(PRESETS)} "
                             f"or NAMExGPUS with NAME among {', '.join(_SHORT)}")
        base = PRESETS[key]
        return replace(base, **({"gpus": gpus} if gpus is not None else {}), **changes)  # type: ignore[arg-type]


H100_500W_CLOCK = 0.75
"""The tensor-core clock an H100 sustains through matmuls at a 500 W cap, as a fraction of
the one its 989 TFLOP/s are quoted at (700 W): the one number of the ``h100-96gb`` preset
that is not on a datasheet (torchtitan's runs state the cap, not the clock it gave), chosen
with every other constant over all published rows at once (``benchmarks.published_runs``)."""

PRESETS: dict[str, Cluster] = {
    "h100-sxm": Cluster(gpus=8, flops=989e12, fp8_flops=1979e12, hbm_bytes=79.11 * GiB, hbm_bw=3.35e12,
                        intra_node_bw=450e9, inter_node_bw=50e9),
    "h100-96gb": Cluster(gpus=8, flops=989e12, fp8_flops=1979e12, hbm_bytes=95.03 * GiB, hbm_bw=2.4e12,
                         intra_node_bw=450e9, inter_node_bw=50e9, clock_fraction=H100_500W_CLOCK),
    "a100-80gb": Cluster(gpus=8, flops=312e12, hbm_bytes=79.25 * GiB, hbm_bw=2.0e12, intra_node_bw=300e9,
                         inter_node_bw=25e9),
}
"""Datasheet numbers (bf16 and fp8 dense peaks, HBM as PyTorch reports it, NVLink per
direction, one NIC per GPU). Memory: an H100 80 GB HBM3 reports 79.11 GiB and an A100 80 GB
79.25 GiB (``total capacity`` in CUDA out-of-memory messages, e.g. vllm-project/vllm#27508);
torchtitan's 96 GB HBM2e H100 95.03 GiB (its log line ``memory: 68.09GiB(71.65%)`` on 8 of
them, pytorch/torchtitan PR 382)."""

_SHORT = {"h100": "h100-sxm", "h100-96gb": "h100-96gb", "a100": "a100-80gb"}
