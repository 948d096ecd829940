"""Acceptance: which drafted path of a verified tree the target keeps, and the bonus token it adds.

All rules return `(path, bonus)`: `path` is a (L+1,) long tensor of node indices from the root (node 0)
to the deepest accepted node, and `bonus` the target's own next token after it (a 0-d long tensor).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specheads.inference.sampling import SamplingParams, sample_token, target_probs
from specheads.inference.sequence_processors import SequenceContext
from specheads.inference.tree import TreeBuffers


def accept_greedy(tokens: torch.Tensor, tree: TreeBuffers, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest path whose tokens equal the target's argmax at their parent, plus the target's bonus token.

    Args:
        tokens: (N,) drafted tokens (tokens[0] is the root, already the target's choice).
        tree: the tree's buffers.
        target_argmax: (N,) the target's argmax next token at each node.

    Returns:
        (path, bonus).
    """
    # correct[i]: node i's token is what the target predicts after its parent (the root is always correct).
    correct = tokens == target_argmax[tree.parents.clamp(min=0)]
    correct[0] = True
    # A node is accepted when it and all its ancestors are correct.
    accepted = ~(tree.ancestors & ~correct[None, :]).any(dim=-1)
    best = torch.argmax(torch.where(accepted, tree.depth, -1))  # deepest accepted node (siblings differ)
    path = torch.nonzero(tree.ancestors[best]).squeeze(-1)  # ancestors in index (= depth) order
    return path, target_argmax[best]


def accept_greedy_reached(
    tokens: torch.Tensor, tree: TreeBuffers, argmax_at: Callable[[list[int]], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_greedy`, asking for the target's argmax only at the nodes it can accept (for per-node processing
    that costs: logits processors, a caller's constraint).

    Depth by depth, `argmax_at(nodes)` gives the (n,) argmax at the accepted nodes of one depth; their children
    holding that token are the next depth's accepted nodes. The deepest accepted node (the first of equal depth,
    as `accept_greedy`) ends the path and its argmax is the bonus. Nodes below a rejected one are never scored: the
    processors run on (accepted length + 1) nodes, not the whole tree.
    """
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(node)
    drafted = tokens.tolist()
    argmax: dict[int, int] = {}
    frontier, accepted = [0], [0]
    while frontier:  # the accepted nodes of one depth
        for node, choice in zip(frontier, argmax_at(frontier).tolist()):
            argmax[node] = choice
        frontier = [kid for node in frontier for kid in children.get(node, ()) if drafted[kid] == argmax[node]]
        accepted += frontier
    depths = tree.depth.tolist()
    best = max(accepted, key=lambda node: (depths[node], -node))
    path = torch.nonzero(tree.ancestors[best]).squeeze(-1)
    return path, torch.tensor(argmax[best], device=tokens.device)


def accept_sampling(
    tokens: torch.Tensor, tree: TreeBuffers, probs: torch.Tensor | Callable[[int], torch.Tensor],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact recursive rejection sampling over sibling candidates (lossless).

    At the current node with target distribution p (already temperature/top-k/top-p processed), the
    children are deterministic candidates t_1, t_2, ... (drafted tokens, in draft order). For each in turn:
    accept t_i with its probability under the residual, p(t_i) / (1 - p(t_1) - ... - p(t_{i-1})); otherwise
    remove it (the residual max(p - q, 0) with q = one-hot(t_i)) and renormalise. If every child is
    rejected, the bonus token is sampled from the residual. The emitted token is therefore distributed
    exactly as p: P(t_1) = p(t_1), P(t_2) = (1 - p(t_1)) * p(t_2) / (1 - p(t_1)) = p(t_2), ...
    One level costs one vector of uniforms: child i is accepted iff u_i < its residual probability and
    no earlier child was.

    Args:
        tokens: (N,) drafted tokens.
        tree: the tree's buffers.
        probs: (N, V) target probabilities at each node, or a function node -> (V,) probabilities (asked only
            at the nodes the walk reaches, parents first).
        generator: the random numbers' source (None: torch's global one).

    Returns:
        (path, bonus).
    """
    probs_at = probs if callable(probs) else probs.__getitem__
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(node)
    node, path = 0, [0]
    while True:
        p = probs_at(node)  # p: the target's distribution at this node
        kids = children.get(node)
        if not kids:
            return torch.tensor(path, device=tokens.device), sample_token(p, generator)
        kid_tokens = tokens[kids]  # (m,) candidates in draft order
        m = kid_tokens.shape[0]
        # A repeated candidate has no mass left once its first occurrence was rejected.
        first = (kid_tokens[:, None] == kid_tokens[None, :]).long().argmax(dim=1) == torch.arange(m, device=p.device)
        q = p[kid_tokens] * first  # (m,) target mass of each distinct candidate
        mass_left = (1.0 - (torch.cumsum(q, 0) - q)).clamp_min(1e-12)  # residual mass before candidate i
        hits = torch.nonzero(torch.rand(m, device=p.device, generator=generator) < q / mass_left)
        if hits.numel():
            node = kids[int(hits[0])]
            path.append(node)
            continue
        residual = p.clone()
        residual[kid_tokens] = 0.0  # every candidate was rejected
        total = residual.sum()
        return torch.tensor(path, device=tokens.device), sample_token(residual / total if total > 0 else p, generator)


def accept_typical(
    tokens: torch.Tensor,
    tree: TreeBuffers,
    probs: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa's typical acceptance. LOSSY: outputs do not follow the target's distribution exactly.

    A drafted token is accepted when the target gives it probability above
    min(posterior_threshold, posterior_alpha * exp(-entropy(p))); the longest such path wins and the bonus
    token is sampled from the target at its end. Faster for high temperatures, but opt-in only.
    """
    entropy = -(probs * torch.log(probs.clamp_min(1e-10))).sum(-1)  # (N,)
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    parent = tree.parents.clamp(min=0)
    p_of_token = probs[parent, tokens]  # (N,) target prob of each node's token at its parent
    correct = p_of_token > threshold[parent]
    correct[0] = True
    accepted = ~(tree.ancestors & ~correct[None, :]).any(dim=-1)
    best = torch.argmax(torch.where(accepted, tree.depth, -1))
    path = torch.nonzero(tree.ancestors[best]).squeeze(-1)
    return path, sample_token(probs[best], generator)


def accept_tree(
    tokens: torch.Tensor,
    tree: TreeBuffers,
    logits: torch.Tensor,
    params: SamplingParams,
    acceptance: str = "exact",
    context: SequenceContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for these decoding options: greedy, exact rejection sampling, or typical.

    Args:
        tokens: (N,) drafted tokens; tree: their buffers; logits: (N, V) target logits at each node.
        params: greedy when `params.do_sample` is False; acceptance: "exact" or "typical" (sampling only).
        context: the row's sequence and processors that read it (inference/sequence_processors.py), when any:
            each node's logits are then processed with its own path, and (exact rules) only at the nodes the
            acceptance reaches.
    """
    if context is not None:
        if acceptance == "exact" and not params.do_sample:
            return accept_greedy_reached(tokens, tree, lambda nodes: context.nodes(logits, tokens, tree, nodes).argmax(-1))
        if acceptance == "exact":
            return accept_sampling(
                tokens, tree, lambda node: target_probs(context.nodes(logits, tokens, tree, [node]), params)[0],
                params.generator,
            )
        logits = context.tree(logits, tokens, tree)  # typical acceptance reads every node's distribution
    if not params.do_sample:
        return accept_greedy(tokens, tree, logits.argmax(dim=-1))
    probs = target_probs(logits, params)
    if acceptance == "typical":
        return accept_typical(tokens, tree, probs, generator=params.generator)
    return accept_sampling(tokens, tree, probs, params.generator)
