"""Rank body for tutorial 09 (torchtitan on pippy_split), in a module of its own: a rank started
by ``run_ranks`` imports its function from here (see tutorial_ranks.py for why)."""

from __future__ import annotations

import dataclasses

import torch
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.models.llama3 as llama3
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import Llama3Model, model_registry

from pippy_split.integrations.torchtitan import pipeline_llm

__all__ = ["tiny_llama3", "model_spec", "trainer_sequence", "BATCH", "SEQ"]

BATCH, SEQ, VOCAB, DIM = 4, 8, 64, 32


def tiny_llama3() -> Llama3Model.Config:
    """torchtitan's Llama 3 at a tiny size, its attention switched to SDPA (flex has no CPU backward)."""
    layers = llama3._build_llama3_layers(
        n_layers=4, dim=DIM, n_heads=4, n_kv_heads=2, hidden_dim=64, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=DIM // 4, max_seq_len=64, theta=500000, scaling="llama"))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        vocab_size=VOCAB, dim=DIM, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._LINEAR_INIT))


def model_spec():
    """The one change to a torchtitan model spec: its pipelining_fn is pippy_split's."""
    spec = model_registry("debugmodel", attn_backend="flex")
    return dataclasses.replace(spec, model=tiny_llama3(), pipelining_fn=pipeline_llm)


def trainer_sequence(rank: int, world: int, schedule: str, tokens: torch.Tensor, labels: torch.Tensor,
                     weights: dict[str, torch.Tensor]) -> dict:
    """What torchtitan's Trainer does with pipeline parallelism, call by call (its Trainer has no
    CPU path): meta build, ``pipelining_fn``, ``to_empty``, ``init_weights``, ``step``."""
    tt_parallel_dims.device_type = "cpu"  # torchtitan assumes CUDA when it finds no accelerator
    spec = model_spec()
    with torch.device("meta"):
        model = spec.model.build()
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=world, ep=1, world_size=world,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    parallelism = ParallelismConfig(pipeline_parallel_degree=world, pipeline_parallel_schedule=schedule,
                                    pipeline_parallel_microbatch_size=1, spmd_backend="partial_dtensor")
    sched, parts, has_first, has_last = spec.pipelining_fn(
        model, parallel_dims=parallel_dims, training=TrainingConfig(local_batch_size=BATCH, seq_len=SEQ,
                                                                    mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp",
        device=torch.device("cpu"), model_config=spec.model, parallelize_fn=spec.parallelize_fn,
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()))
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
            for name, p in m.named_parameters():  # the unsplit model's weights, as from a seed checkpoint
                (p.to_local() if isinstance(p, DTensor) else p).copy_(weights[name])  # FSDP2 over 1 rank: whole
        m.train()
    losses: list | None = [] if has_last else None
    sched.step(arg_mbs=[(t,) for t in tokens.chunk(BATCH)] if has_first else None, kwarg_mbs=[{}] * BATCH,
               target_mbs=list(labels.chunk(BATCH)) if has_last else None, losses=losses,
               loss_kwargs={"global_valid_tokens": torch.tensor(labels.numel())}, return_outputs=False)
    return {"schedule": type(sched).__name__, "stages": [st.stage_index for st in sched.stages],
            "modules": [sorted(n for n, _ in m.named_modules() if n.count(".") == 1 or n in ("tok_embeddings", "norm",
                                                                                          "lm_head")) for m in parts],
            "loss": torch.stack(losses).sum() if has_last else None,
            "grads": {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                      for m in parts for n, p in m.named_parameters()}}
