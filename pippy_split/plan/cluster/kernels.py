"""How fast one kernel runs on a :class:`.hardware.Cluster`: a matmul by its shape, flash
attention, a memory-bound pass over bytes, a collective over a link. The constants
(:data:`KERNELS`) are one set for every model, layout and cluster the planner prices:
set from what the kernels are known to reach (cuBLAS, FlashAttention-2 and cuDNN on H100 and
A100), then adjusted by hand, the same for every row, against the 28 published runs of
``benchmarks.published_runs`` (no row held back; of four rows found later, the 8B one is still
held out, the 405B table's Float8 gain was in view when ``fp8_gemm_fraction`` was re-chosen).
Nothing is fitted per row, model or table.

Sits under :mod:`.block` (a transformer block as a list of these kernels) and
:mod:`.costs`. The model, stated:

* **Matmul** ``(M x K) @ (K x N)``: ``2 M N K`` FLOPs at ``peak x gemm_fraction x
  f(M) f(N) f(K)``, ``f(d) = d / (d + gemm_half_dim)`` (a tile-quantized GEMM reaches its
  plateau only when every dimension spans many tiles: wide models run faster per FLOP),
  or its bytes at the HBM bandwidth if that is longer (the roofline). Float8 matmuls use
  the cluster's ``fp8_flops`` and ``fp8_gemm_fraction`` (their plateau is a smaller share
  of a peak twice as high).
* **Attention** (flash, causal): ``2 s d`` FLOPs per query token and head dimension
  ``d`` forward (two ``s x s`` products halved by the mask), 2.5 x that backward, at the
  runtime's attention kernel's fraction of the bf16 peak (attention never runs in Float8)
  times ``f(L)^2``, ``L`` the query and key length one kernel call sees (a sequence, or its
  ``s / cp`` shard under ring attention): the matmuls' tile rule over attention's two
  sequence dimensions (a short sequence amortizes each tile row's softmax rescale and output
  write, and the causal diagonal's partial tiles, over fewer tiles). The head dimension is
  fixed (128) and in the kernel's fraction.
* **Memory-bound** passes (norms, rotary, SwiGLU, residual adds, Float8 casts and amax,
  the loss over the logits, the optimizer step): bytes at ``hbm_bw x hbm_fraction``.
* **Collectives and messages**: bytes at the link's bandwidth times ``link_fraction``.

Example:
    >>> from .hardware import Cluster
    >>> c = Cluster(gpus=1, flops=1e15)
    >>> wide, narrow = gemm_s(8192, 8192, 8192, c), gemm_s(8192, 256, 8192, c)
    >>> round(wide / narrow / 32, 2)  # 32x the FLOPs, at a higher efficiency
    0.68
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster

__all__ = ["Kernels", "KERNELS", "gemm_s", "attention_s", "memory_s", "link_s"]


@dataclass(frozen=True)
class Kernels:
    """The planner's kernel constants (one set, shared by every prediction)."""

    gemm_fraction: float = 0.80
    """The share of the bf16 peak a large bf16 GEMM reaches (cuBLAS on H100 and A100)."""
    fp8_gemm_fraction: float = 0.66
    """The share of the Float8 peak a large Float8 GEMM reaches (1,306 of an H100 SXM's 1,979
    TFLOP/s). Set by the published pairs that differ only in Float8 (torchtitan's 8B with
    torch.compile, and its 405B table, FSDP 16 x TP 8): their gains, 1.28 and 1.62, put it at
    0.66 or above; NeMo's FP8 rows, which have no bf16 twin, bound it from above (its Llama 3 8B
    at CP 2 reaches +15% near 0.69). It was 0.62 while that row, without ring attention's
    per-round correction priced, reached +16% at 0.655 (issue 43)."""
    gemm_half_dim: float = 128.0
    """The GEMM dimension at which that dimension alone halves the efficiency."""
    attention_fraction: tuple[tuple[str, float, float], ...] = (("flash2", 0.33, 0.26), ("cudnn", 0.50, 0.38))
    """Per attention kernel: its forward and backward share of the bf16 peak (causal)."""
    hbm_fraction: float = 0.80
    """The share of the HBM bandwidth a streaming elementwise kernel reaches."""
    link_fraction: float = 0.80
    """The share of a link's bandwidth NCCL's collectives and messages reach."""
    overlap_fraction: float = 0.5
    """The share of a collective that overlapping it with the matmuls it feeds (async TP)
    actually hides: the transfer and the matmuls share the GPU's memory bandwidth and SMs."""

    def attention(self, kernel: str) -> tuple[float, float]:
        """Forward and backward fractions of ``kernel`` ("flash2" or "cudnn")."""
        for name, fwd, bwd in self.attention_fraction:
            if name == kernel:
                return fwd, bwd
        raise ValueError(f"unknown attention kernel {kernel!r}; known: "
                         f"{', '.join(n for n, _, _ in self.attention_fraction)}")


KERNELS = Kernels()


def _shape_factor(d: float, k: Kernels) -> float:
    return d / (d + k.gemm_half_dim)


def gemm_s(m: float, n: float, k: float, cluster: Cluster, fp8: bool = False, kernels: Kernels = KERNELS) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` matmul (see the module docstring); with a flat
    ``cluster.efficiency`` every matmul runs at that share of ``flops`` instead.

    Example:
        >>> from .hardware import Cluster
        >>> round(gemm_s(4096, 4096, 4096, Cluster(gpus=1, flops=1e12, efficiency=0.5)), 3)
        0.275
    """
    flops = 2.0 * m * n * k
    if cluster.efficiency is not None:
        rate = cluster.flops * cluster.efficiency
    elif fp8 and cluster.fp8_flops:
        rate = cluster.fp8_flops * cluster.clock_fraction * kernels.fp8_gemm_fraction
    else:
        rate = cluster.dense_flops * kernels.gemm_fraction
    if cluster.efficiency is None:
        rate *= _shape_factor(m, kernels) * _shape_factor(n, kernels) * _shape_factor(k, kernels)
    elem = 1 if fp8 else 2
    moved = elem * (m * k + k * n) + 2 * m * n
    return max(flops / rate, moved / cluster.hbm_bw)


def attention_s(query_tokens: float, seq_len: float, width: float, cluster: Cluster, kernel: str = "flash2",
                backward: bool = False, kernels: Kernels = KERNELS, block_len: float | None = None) -> float:
    """Seconds of causal flash attention for ``query_tokens`` queries over sequences of
    ``seq_len``, ``width`` = heads x head dim on this GPU; ``backward``: its backward;
    ``block_len``: the query and key length one kernel call sees (``seq_len / cp`` under ring
    attention; ``None``: ``seq_len``), which sets the efficiency ``f(block_len)^2``.

    Example:
        >>> from .hardware import Cluster
        >>> c = Cluster(gpus=1, flops=1e15)
        >>> round(attention_s(8192, 8192, 4096, c, backward=True) / attention_s(8192, 8192, 4096, c), 2)
        3.17
    """
    flops = 2.0 * seq_len * width * query_tokens * (2.5 if backward else 1.0)
    if cluster.efficiency is not None:
        return flops / (cluster.flops * cluster.efficiency)
    fwd, bwd = kernels.attention(kernel)
    shape = _shape_factor(seq_len if block_len is None else block_len, kernels) ** 2
    return flops / (cluster.dense_flops * (bwd if backward else fwd) * shape)


def memory_s(nbytes: float, cluster: Cluster, kernels: Kernels = KERNELS) -> float:
    """Seconds of memory-bound kernels moving ``nbytes`` through HBM."""
    return nbytes / (cluster.hbm_bw * kernels.hbm_fraction)


def link_s(nbytes: float, bandwidth: float, kernels: Kernels = KERNELS) -> float:
    """Seconds to move ``nbytes`` over a link of ``bandwidth`` bytes/s."""
    return nbytes / (bandwidth * kernels.link_fraction)
