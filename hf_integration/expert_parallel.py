"""Expert parallelism over ``torch.distributed``: each rank keeps ``E / world_size`` experts of
every NVFP4 MoE layer; a dispatch step around the op shifts the router's ids to the rank's experts
and all-reduces the ranks' partial outputs.

    torchrun --nproc-per-node 2 my_script.py
        dist.init_process_group("nccl")            # "gloo" on CPU
        model = load_modelopt_nvfp4(path, expert_parallel=True)   # reads only this rank's experts
        # or: shard_experts(patch_deepseek(model))

Rank r holds global experts ``[r*E/N, (r+1)*E/N)``. The router still sees all ``E`` experts; each
rank shifts the ids by its offset, so other ranks' experts fall outside ``[0, E/N)`` and
contribute nothing in ``fp4moe::fused_moe`` (the op's sentinel rule). Attention, router, shared
experts and dense layers stay replicated. The all-reduce is a functional collective, so
``torch.compile(fullgraph=True)`` traces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fp4moe_ops import NVFP4MoEWeights

from .checkpoint_format import CheckpointError
from .surgery import nvfp4_experts


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts ``[offset, offset + count)`` of every layer, as the dispatch step of
    :class:`hf_integration.experts.NVFP4Experts`."""

    rank: int
    world_size: int
    offset: int
    count: int
    group: object = None

    @property
    def routed_experts(self) -> int:
        return self.count * self.world_size

    def prepare(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's local ids (others' experts fall outside ``[0, count)``)."""
        return top_k_index - self.offset

    def finalize(self, out: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial MoE outputs (in float32)."""
        import torch.distributed._functional_collectives as funcol

        total = funcol.all_reduce(out.float(), "sum", self.group if self.group is not None else dist.group.WORLD)
        return funcol.wait_tensor(total).to(out.dtype)


def expert_shard(num_experts: int, rank: int, world_size: int, group=None) -> ExpertShard:
    """The shard of ``num_experts`` for ``rank``; the same error on every rank if it does not split."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over world size {world_size}; "
                         f"use a world size that divides {num_experts}")
    count = num_experts // world_size
    return ExpertShard(rank, world_size, rank * count, count, group)


def this_rank_shard(num_experts: int, group=None) -> ExpertShard:
    return expert_shard(num_experts, dist.get_rank(group), dist.get_world_size(group), group)


def same_outcome_on_every_rank(what: str, fn, group=None):
    """Run ``fn()`` on every rank and return its result; if it raised on any rank, raise the
    first failing rank's error on every rank. A collective, so no rank is left waiting in a
    later collective for a rank that failed."""
    try:
        result, failure = fn(), None
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        result, failure = None, (type(exc).__name__, str(exc))
    failures = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, failure, group=group)
    kinds = {"CheckpointError": CheckpointError, "ValueError": ValueError, "FileNotFoundError": FileNotFoundError}
    for rank, found in enumerate(failures):
        if found is not None:
            raise kinds.get(found[0], RuntimeError)(f"{what} failed on rank {rank}: {found[1]}")
    return result


def same_on_every_rank(what: str, value, error=ValueError, group=None) -> None:
    """Raise ``error`` on every rank unless every rank passes an equal ``value`` (picklable)."""
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    if any(v != values[0] for v in values):
        differ = [r for r, v in enumerate(values) if v != values[0]]
        raise error(f"ranks disagree on the {what}: rank 0 has {values[0]!r}, rank(s) {differ} have "
                    f"{[values[r] for r in differ]!r}; every rank must load the same checkpoint")


def shard_weights(weights: NVFP4MoEWeights, shard: ExpertShard) -> NVFP4MoEWeights:
    """This rank's experts (copies, so the full stacks can be freed)."""
    sl = slice(shard.offset, shard.offset + shard.count)
    pick = lambda t: None if t is None else t[sl].clone()  # noqa: E731
    return NVFP4MoEWeights(*(pick(t) for t in weights.tensors()), pick(weights.gate_up_input_scale),
                           pick(weights.down_input_scale))


def shard_experts(model: nn.Module, group=None) -> nn.Module:
    """Keep this rank's experts in every NVFP4 experts module and all-reduce their outputs.

    Every module is checked before anything changes, and the check depends only on the model
    (the same on every rank), so a bad world size fails everywhere alike instead of hanging.
    """
    modules = [m for _, m in nvfp4_experts(model)]
    if not modules:
        raise ValueError("shard_experts needs a model with fp4moe NVFP4 experts (patch_deepseek / from_pretrained)")
    if any(isinstance(m.dispatch, ExpertShard) for m in modules):
        raise ValueError("model's experts are already sharded")
    fused = [n for n, m in model.named_modules() if type(m).__name__ == "SharedExpertMoE"]
    if fused:  # every rank would add the shared expert once more
        raise ValueError(f"{fused[0]} runs its shared expert inside the routed experts' call, which expert "
                         "parallelism cannot split: patch with fuse_shared_experts=False (or load without "
                         "fuse_shared_experts=True)")
    shards = [this_rank_shard(m.num_experts, group) for m in modules]
    for m, shard in zip(modules, shards):
        backend, mode = m.backend, m.act_scale_mode
        m.set_weights(shard_weights(m.canonical(), shard))
        m.set_backend(backend, mode)
        use_shard(m, shard)
    return model


def use_shard(module: nn.Module, shard: ExpertShard) -> None:
    """Make ``module`` (holding ``shard``'s experts) dispatch as that shard."""
    module.dispatch = shard
    module.routed_experts = shard.routed_experts


__all__ = ["ExpertShard", "expert_shard", "same_on_every_rank", "same_outcome_on_every_rank", "shard_experts",
           "this_rank_shard", "use_shard"]
