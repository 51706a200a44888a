"""The routers as ops: each turns a layer's router logits into the experts and weights of every
token in one launch on CUDA, where Transformers runs several small kernels (at decode they cost
more GPU time than the router's GEMV).

* ``torch.ops.fp4moe.grouped_topk``: group-limited top-k (DeepSeek-V3's "noaux_tc" router, also
  Kimi-K2 and GLM4-MoE), below.
* ``torch.ops.fp4moe.softmax_topk``: softmax over all experts, the top k, optionally renormalized
  (Qwen2/3-MoE, Qwen3-Next, OLMoE, Mixtral, MiniMax), at the end of this module.

Group-limited top-k, per token, from logits ``[E]`` over ``E`` experts in ``G`` groups of
``E/G``::

    score  = sigmoid(logit)                       # the routing weight source
    choice = score + correction_bias              # only for *choosing* experts
    group score = sum of the 2 largest choices in the group
    keep the topk_group best groups; among their experts take the top_k largest choices
    weight = score of each chosen expert, / (sum of the k weights + 1e-20) if renormalize,
             * scaling_factor

Transformers computes this with ~10 small kernels per layer (three ``topk``, a scatter, a
``masked_fill``, a gather, reductions). On CUDA the op runs it in one Triton launch (one program
per token); elsewhere it runs the same torch ops Transformers runs. Ties between equal choices go to the lower expert id (group:
lower group id); ``torch.topk`` leaves that order unspecified, so on exact ties the two may pick
different (equal-valued) experts.
"""

from __future__ import annotations

import torch

from .relaunch import cdiv, launch, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


def _check(router_logits, correction_bias, n_group, topk_group, top_k):
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise TypeError(f"router_logits must be [T, E] float32, got {router_logits.dtype} "
                        f"{list(router_logits.shape)}")
    e = router_logits.shape[1]
    if correction_bias.shape != (e,) or correction_bias.dtype != torch.float32:
        raise TypeError(f"correction_bias must be float32 [{e}], got {correction_bias.dtype} "
                        f"{list(correction_bias.shape)}")
    if correction_bias.device != router_logits.device:
        raise ValueError(f"correction_bias is on {correction_bias.device}, router_logits on {router_logits.device}")
    if n_group < 1 or e % n_group or e // n_group < 2:
        raise ValueError(f"{e} experts cannot form {n_group} groups of at least 2 (group scores sum the top 2)")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 1 <= top_k <= topk_group * (e // n_group):
        raise ValueError(f"top_k={top_k} must be in [1, {topk_group * (e // n_group)}] "
                         f"(the experts of the {topk_group} kept groups)")


def grouped_topk_torch(router_logits, correction_bias, n_group, topk_group, top_k, renormalize, scaling_factor):
    """The router's definition in torch ops (the op's path off CUDA): the calls Transformers'
    router makes, in its order, so results are bitwise the unpatched model's. Returns
    ``(weights [T, k] float32, ids [T, k] int64)``."""
    t, e = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
    ids = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


if triton is not None:

    @triton.jit
    def _grouped_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, scaling_factor,
                             NUM_EXPERTS: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                             TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                             GROUPS_P2: tl.constexpr, GROUP_P2: tl.constexpr, TOP_K_P2: tl.constexpr):
        """One token per program. The token's experts are held as a [groups, group size] tile
        (padded to powers of two with -inf), so the group step is a row reduction."""
        t = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, GROUPS_P2)
        j = tl.arange(0, GROUP_P2)[None, :]
        valid = (g[:, None] < N_GROUP) & (j < GROUP_SIZE)
        expert = g[:, None] * GROUP_SIZE + j
        logit = tl.load(logits_ptr + t * NUM_EXPERTS + expert, mask=valid, other=0.0)
        score = tl.where(valid, tl.sigmoid(logit), 0.0)  # padding aliases real ids: it must add 0
        choice = tl.where(valid, score + tl.load(bias_ptr + expert, mask=valid, other=0.0), float("-inf"))

        # group score: the two largest choices (a tie counts both, as topk(2) does)
        top1 = tl.max(choice, axis=1)
        top1_at = tl.min(tl.where(choice == top1[:, None], j, GROUP_P2), axis=1)
        top2 = tl.max(tl.where(j == top1_at[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(g < N_GROUP, top1 + top2, float("-inf"))

        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            candidate = tl.where(kept, float("-inf"), group_score)
            best = tl.max(candidate, axis=0)
            pick = tl.min(tl.where((candidate == best) & ~kept & (g < N_GROUP), g, GROUPS_P2), axis=0)
            kept = kept | (g == pick)
        choice = tl.where(kept[:, None], choice, float("-inf"))

        slot = tl.arange(0, TOP_K_P2)
        ids = tl.zeros([TOP_K_P2], dtype=tl.int32)
        weights = tl.zeros([TOP_K_P2], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            best = tl.max(tl.max(choice, axis=1), axis=0)
            pick = tl.min(tl.min(tl.where(choice == best, expert, NUM_EXPERTS), axis=1), axis=0)
            hit = expert == pick
            weight = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=1), axis=0)
            ids = tl.where(slot == k, pick, ids)
            weights = tl.where(slot == k, weight, weights)
            choice = tl.where(hit, float("-inf"), choice)
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=0) + 1e-20)
        out = t * TOP_K + slot
        tl.store(weights_ptr + out, weights * scaling_factor, mask=slot < TOP_K)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < TOP_K)


def grouped_topk_triton(router_logits, correction_bias, n_group, topk_group, top_k, renormalize, scaling_factor):
    """The Triton kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); same contract as
    :func:`grouped_topk_torch`."""
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        launch(_grouped_topk_kernel, (t,), (
            router_logits.contiguous(), correction_bias.contiguous(), weights, ids, float(scaling_factor)), dict(
            NUM_EXPERTS=e, N_GROUP=n_group, GROUP_SIZE=e // n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
            RENORMALIZE=renormalize, GROUPS_P2=next_power_of_2(n_group),
            GROUP_P2=next_power_of_2(e // n_group), TOP_K_P2=next_power_of_2(top_k),
            num_warps=1 if e <= 256 else 4))
    return weights, ids


@torch.library.custom_op("fp4moe::grouped_topk", mutates_args=())
def grouped_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, n_group: int, topk_group: int,
                 top_k: int, renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing (see the module docstring).

    Args:
        router_logits: ``[T, E]`` float32, the router's ``hidden @ W.T``.
        correction_bias: ``[E]`` float32, added to the sigmoid scores for choosing only.
        n_group, topk_group: ``E`` experts form ``n_group`` groups; ``topk_group`` are kept.
        top_k: experts per token.
        renormalize: divide each token's weights by their sum (DeepSeek's ``norm_topk_prob``).
        scaling_factor: multiplies the weights (``routed_scaling_factor``).

    Returns:
        ``(weights [T, k] float32, ids [T, k] int64)``; order within a row is not specified.
    """
    _check(router_logits, correction_bias, n_group, topk_group, top_k)
    run = grouped_topk_triton if router_logits.is_cuda and triton is not None else grouped_topk_torch
    return run(router_logits, correction_bias, n_group, topk_group, top_k, renormalize, scaling_factor)


@grouped_topk.register_fake
def _(router_logits, correction_bias, n_group, topk_group, top_k, renormalize, scaling_factor):
    _check(router_logits, correction_bias, n_group, topk_group, top_k)
    t = router_logits.shape[0]
    return (router_logits.new_empty(t, top_k), router_logits.new_empty(t, top_k, dtype=torch.int64))


# Softmax top-k -----------------------------------------------------------------------------------
#
#     prob   = softmax(logits) in float32 over all E experts
#     ids    = the top_k largest probs (ties: the lower expert id)
#     weight = prob of each chosen expert, / (sum of the k probs) if renormalize
#
# Transformers runs a softmax, torch.topk (a radix select and a sort, even for 128 experts) and the
# division as separate kernels; benchmarks/NOTES.md ("Router") says what they cost.


def _check_softmax(router_logits, top_k):
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise TypeError(f"router_logits must be [T, E] floating point, got {router_logits.dtype} "
                        f"{list(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k={top_k} must be in [1, {router_logits.shape[1]}] (the experts)")


def softmax_topk_torch(router_logits, top_k, renormalize):
    """The router's definition in the torch calls Transformers' Qwen3-MoE router makes, in its
    order (bitwise its results; the op's path off CUDA). Returns ``(weights [T, k] float32,
    ids [T, k] int64)``. Between exactly equal probabilities ``torch.topk``'s choice is unspecified;
    the kernel takes the lower expert id."""
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


if triton is not None:

    @triton.jit
    def _softmax_topk_row(logit, weights_ptr, ids_ptr, t, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
                          TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr):
        """One token's softmax top-k from its ``[EXPERTS_P2]`` float32 logits (padding -inf): the
        top k by k passes of max, stored at row ``t``."""
        expert = tl.arange(0, EXPERTS_P2)
        valid = expert < NUM_EXPERTS
        e = tl.where(valid, tl.exp(logit - tl.max(logit, axis=0)), 0.0)
        prob = e / tl.sum(e, axis=0)
        choice = tl.where(valid, prob, float("-inf"))  # padding is never chosen

        slot = tl.arange(0, TOP_K_P2)
        ids = tl.zeros([TOP_K_P2], dtype=tl.int32)
        weights = tl.zeros([TOP_K_P2], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            best = tl.max(choice, axis=0)
            pick = tl.min(tl.where(choice == best, expert, EXPERTS_P2), axis=0)
            ids = tl.where(slot == k, pick, ids)
            weights = tl.where(slot == k, best, weights)
            choice = tl.where(expert == pick, float("-inf"), choice)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
        out = t * TOP_K + slot
        tl.store(weights_ptr + out, weights, mask=slot < TOP_K)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < TOP_K)

    @triton.jit
    def _softmax_topk_kernel(logits_ptr, stride_t, weights_ptr, ids_ptr, NUM_EXPERTS: tl.constexpr,
                             EXPERTS_P2: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                             RENORMALIZE: tl.constexpr):
        """One token per program: its E logits in registers, :func:`_softmax_topk_row`."""
        t = tl.program_id(0).to(tl.int64)
        expert = tl.arange(0, EXPERTS_P2)
        logit = tl.load(logits_ptr + t * stride_t + expert, mask=expert < NUM_EXPERTS,
                        other=float("-inf")).to(tl.float32)
        _softmax_topk_row(logit, weights_ptr, ids_ptr, t, NUM_EXPERTS, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE)

    @triton.jit
    def _router_softmax_topk_kernel(x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr, H,
                                    NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr, BE: tl.constexpr,
                                    BH: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                                    RENORMALIZE: tl.constexpr):
        """Program ``(p, t)``: the logits of experts ``p BE .. (p + 1) BE`` for token ``t``, float32
        sums of the exact 16-bit products rounded to the logits' dtype, as ``F.linear``'s output is;
        the last of the token's programs to arrive (``count [t]``, zero between calls: that program
        sets it back) reads all its logits from L2 and runs :func:`_softmax_topk_row`."""
        p = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)
        experts = p * BE + tl.arange(0, BE)
        acc = tl.zeros((BE, BH), dtype=tl.float32)
        for h0 in range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            x = tl.load(x_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + experts[:, None].to(tl.int64) * H + h[None, :],
                        mask=(experts[:, None] < NUM_EXPERTS) & (h[None, :] < H), other=0.0).to(tl.float32)
            acc += w * x[None, :]
        logit = tl.sum(acc, axis=1).to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + t * NUM_EXPERTS + experts, logit, mask=experts < NUM_EXPERTS)
        tl.debug_barrier()  # this program's logits are stored before it counts itself
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            expert = tl.arange(0, EXPERTS_P2)
            row = tl.load(logits_ptr + t * NUM_EXPERTS + expert, mask=expert < NUM_EXPERTS, other=float("-inf"),
                          cache_modifier=".cg").to(tl.float32)  # from L2, where the other programs' stores are
            _softmax_topk_row(row, weights_ptr, ids_ptr, t, NUM_EXPERTS, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE)
            tl.atomic_xchg(count_ptr + t, 0)  # ready for the next call (and a graph's next replay)


def softmax_topk_triton(router_logits, top_k, renormalize):
    """The Triton kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); same contract as
    :func:`softmax_topk_torch`."""
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        launch(_softmax_topk_kernel, (t,), (logits, logits.stride(0), weights, ids), dict(
            NUM_EXPERTS=e, EXPERTS_P2=next_power_of_2(e), TOP_K=top_k, TOP_K_P2=next_power_of_2(top_k),
            RENORMALIZE=renormalize, num_warps=1 if e <= 256 else 4))
    return weights, ids


@torch.library.custom_op("fp4moe::softmax_topk", mutates_args=())
def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (see the comment above :func:`softmax_topk_torch`).

    Args:
        router_logits: ``[T, E]`` in any floating dtype (the router's ``hidden @ W.T``); the
            softmax runs in float32.
        top_k: experts per token.
        renormalize: divide each token's weights by their sum (``norm_topk_prob``).

    Returns:
        ``(weights [T, k] float32, ids [T, k] int64)``; order within a row is not specified.
    """
    _check_softmax(router_logits, top_k)
    run = softmax_topk_triton if router_logits.is_cuda and triton is not None else softmax_topk_torch
    return run(router_logits, top_k, renormalize)


@softmax_topk.register_fake
def _(router_logits, top_k, renormalize):
    _check_softmax(router_logits, top_k)
    t = router_logits.shape[0]
    return (router_logits.new_empty(t, top_k, dtype=torch.float32),
            router_logits.new_empty(t, top_k, dtype=torch.int64))


# The router's GEMV and softmax top-k in one launch ----------------------------------------------
#
#     logits = hidden @ weight.T   in hidden's dtype (float32 sums of the exact 16-bit products)
#     (weights, ids) = softmax_topk(logits, top_k, renormalize)
#
# At decode the router's GEMV (E x H, 0.5 MB for Qwen3-30B-A3B) is a cuBLAS launch of ~5 us on an
# H100 and softmax_topk another ~2 us; one launch does both for up to ROUTER_FUSED_MAX_TOKENS tokens
# (each token's programs re-read the weight, from L2 after the first), cuBLAS and softmax_topk's
# kernel beyond.

ROUTER_FUSED_MAX_TOKENS = 16
ROUTER_COUNTERS = ROUTER_FUSED_MAX_TOKENS  # one arrival counter per token of a fused launch


def router_counters(device) -> torch.Tensor:
    """A zeroed ``[ROUTER_COUNTERS] int32`` table for :func:`router_softmax_topk` (zero between
    calls; calls sharing one must not run at the same time, on two streams)."""
    return torch.zeros(ROUTER_COUNTERS, dtype=torch.int32, device=device)


def _check_router(hidden, weight, counters, top_k):
    if hidden.dim() != 2 or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"hidden must be [T, H] bfloat16/float16/float32, got {hidden.dtype} {list(hidden.shape)}")
    if weight.dim() != 2 or weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[1]:
        raise TypeError(f"weight must be [E, H={hidden.shape[1]}] {hidden.dtype} like hidden, got {weight.dtype} "
                        f"{list(weight.shape)}")
    if counters.dtype != torch.int32 or counters.shape != (ROUTER_COUNTERS,):
        raise TypeError(f"counters must be router_counters(): [{ROUTER_COUNTERS}] int32, got {counters.dtype} "
                        f"{list(counters.shape)}")
    for name, t in (("weight", weight), ("counters", counters)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if not 1 <= top_k <= weight.shape[0]:
        raise ValueError(f"top_k={top_k} must be in [1, {weight.shape[0]}] (the experts)")


def router_softmax_topk_triton(hidden, weight, counters, top_k, renormalize):
    """The fused launch (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``), for at most
    :data:`ROUTER_FUSED_MAX_TOKENS` tokens; same contract as :func:`router_softmax_topk`."""
    t, h = hidden.shape
    e = weight.shape[0]
    if t > ROUTER_COUNTERS:  # one arrival counter per token
        raise ValueError(f"the fused router launch takes at most {ROUTER_COUNTERS} tokens, got {t}")
    logits = torch.empty(t, e, dtype=hidden.dtype, device=hidden.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=hidden.device)
    if t:
        bh = min(next_power_of_2(h), 4096)
        be = max(1, min(next_power_of_2(e), 8192 // bh))
        launch(_router_softmax_topk_kernel, (cdiv(e, be), t), (
            hidden.contiguous(), weight.contiguous(), logits, weights, ids, counters, h), dict(
            NUM_EXPERTS=e, EXPERTS_P2=next_power_of_2(e), BE=be, BH=bh, TOP_K=top_k,
            TOP_K_P2=next_power_of_2(top_k), RENORMALIZE=renormalize, num_warps=4))
    return logits, weights, ids


# ``counters`` is written during a call but left as it was found (all zero): no mutation to declare,
# so the op stays functional (as fp4moe::nvfp4_linear's split-K counters)
@torch.library.custom_op("fp4moe::router_softmax_topk", mutates_args=())
def router_softmax_topk(hidden: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor, top_k: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A softmax top-k router whole: its GEMV, then :func:`softmax_topk` (see the comment above).

    Args:
        hidden: ``[T, H]`` 16-bit or float32 activations.
        weight: ``[E, H]`` the router's weight, in hidden's dtype.
        counters: :func:`router_counters` (the fused launch's arrival counters).
        top_k, renormalize: as :func:`softmax_topk`.

    Returns:
        ``(logits [T, E] in hidden's dtype, weights [T, k] float32, ids [T, k] int64)``. Off CUDA,
        ``F.linear`` then :func:`softmax_topk`: bitwise Transformers' router. On CUDA the logits'
        summation order differs from cuBLAS's: a logit may round to a neighbouring value (further
        apart, relative to its size, where the sum cancels to near zero).
    """
    _check_router(hidden, weight, counters, top_k)
    if hidden.is_cuda and triton is not None and hidden.shape[0] <= ROUTER_FUSED_MAX_TOKENS:
        return router_softmax_topk_triton(hidden, weight, counters, top_k, renormalize)
    logits = torch.nn.functional.linear(hidden, weight)
    return (logits, *softmax_topk(logits, top_k, renormalize))


@router_softmax_topk.register_fake
def _(hidden, weight, counters, top_k, renormalize):
    _check_router(hidden, weight, counters, top_k)
    t, e = hidden.shape[0], weight.shape[0]
    return (hidden.new_empty(t, e), hidden.new_empty(t, top_k, dtype=torch.float32),
            hidden.new_empty(t, top_k, dtype=torch.int64))
