"""Draft trees as data: tokens + parent indices -> attention mask, positions and root-to-leaf paths.

A draft tree of N nodes is stored as two (N,) tensors: `tokens` and `parents`. Node 0 is the root (the
token the target itself chose last round, parent -1); every other node's parent has a smaller index
(topological order), so ancestors always precede descendants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml


@dataclass(frozen=True)
class TreeBuffers:
    """Everything verification and acceptance need about a tree's shape (not its tokens).

    Attributes:
        parents: (N,) parent index of each node, -1 for the root.
        depth: (N,) distance from the root (root = 0).
        ancestors: (N, N) bool, ancestors[i, j] = node j is node i or one of its ancestors.
        attention_bias: (N, N) additive float mask: 0 where `ancestors`, a large negative value elsewhere.
        retrieve_indices: (P, D+1) node indices of each root-to-leaf path, padded with -1 (computed on
            first use: greedy acceptance works from `ancestors` and never needs it).
    """

    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    attention_bias: torch.Tensor

    @cached_property
    def retrieve_indices(self) -> torch.Tensor:
        return retrieve_paths(self.ancestors, self.depth)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]


def build_tree_buffers(
    parents: torch.Tensor, dtype: torch.dtype = torch.float32, check: bool = True, max_depth: int | None = None
) -> TreeBuffers:
    """Turn parent indices into the buffers that verify a tree in one forward pass.

    Each node attends to the cached prefix (handled by the caller) and to exactly its ancestors and itself;
    its position id is prefix length + depth. Vectorised over nodes: the only loop runs once per tree level.

    Args:
        parents: (N,) long tensor, parents[0] == -1 and 0 <= parents[i] < i for i > 0.
        dtype: dtype of `attention_bias` (the target's dtype).
        check: validate `parents` (two host syncs); drafters that build valid trees by construction skip it.
        max_depth: a bound on the tree's depth: then exactly that many passes run, with no host sync (what a
            CUDA graph needs); None repeats passes until nothing changes (one host sync per level).

    Returns:
        The `TreeBuffers` of this tree.

    Raises:
        ValueError: if `parents` is not a valid topologically ordered tree rooted at node 0.
    """
    parents = parents.long()
    n = parents.shape[0]
    if check:
        if parents.dim() != 1 or n == 0 or parents[0].item() != -1:
            raise ValueError(f"parents must be a non-empty 1-D tensor with parents[0] == -1, got {parents.tolist()}")
        index = torch.arange(n, device=parents.device)
        if n > 1 and not bool(((parents[1:] >= 0) & (parents[1:] < index[1:])).all()):
            raise ValueError(f"parents must satisfy 0 <= parents[i] < i for i > 0, got {parents.tolist()}")

    # ancestors[i] = {i} | ancestors[parent[i]]; each pass fixes one more level (at most depth passes).
    identity = torch.eye(n, dtype=torch.bool, device=parents.device)
    ancestors = identity
    safe_parents = parents.clamp(min=0)
    has_parent = parents >= 0
    passes = 0
    while max_depth is None or passes < max_depth:
        new_ancestors = identity | (ancestors[safe_parents] & has_parent[:, None])
        if max_depth is None and torch.equal(new_ancestors, ancestors):
            break
        ancestors, passes = new_ancestors, passes + 1
    depth = ancestors.sum(-1) - 1

    attention_bias = torch.zeros(n, n, dtype=dtype, device=parents.device)
    attention_bias.masked_fill_(~ancestors, torch.finfo(dtype).min)
    return TreeBuffers(parents, depth, ancestors, attention_bias)


def truncate_tree(tree: TreeBuffers, count: int) -> TreeBuffers:
    """The first `count` nodes of `tree` (topologically ordered, so they form a tree: every kept node's ancestors come
    before it), as buffers sliced from the tree's own."""
    if count >= tree.num_nodes:
        return tree
    return TreeBuffers(tree.parents[:count], tree.depth[:count], tree.ancestors[:count, :count],
                       tree.attention_bias[:count, :count])


def append_chain(tree: TreeBuffers, parent: int, length: int) -> TreeBuffers:
    """The buffers of `tree` with a chain of `length` new nodes hung under node `parent` (appended in order:
    node N is the parent's child, N + 1 its child, ...). Derived from the tree's own buffers: no passes, no host sync.
    """
    n, device, dtype = tree.num_nodes, tree.parents.device, tree.attention_bias.dtype
    m = n + length
    ancestors = torch.zeros(m, m, dtype=torch.bool, device=device)
    ancestors[:n, :n] = tree.ancestors
    ancestors[n:, :n] = tree.ancestors[parent]  # every chain node sees the parent's path ...
    ancestors[n:, n:] = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # ... and the chain so far
    chain_parents = torch.arange(n - 1, m - 1, device=device)
    chain_parents[0] = parent
    parents = torch.cat([tree.parents, chain_parents.to(tree.parents.dtype)])
    depth = torch.cat([tree.depth, tree.depth[parent] + torch.arange(1, length + 1, device=device)])
    attention_bias = torch.zeros(m, m, dtype=dtype, device=device).masked_fill_(~ancestors, torch.finfo(dtype).min)
    return TreeBuffers(parents, depth, ancestors, attention_bias)


def retrieve_paths(ancestors: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """(P, D+1) node indices of every root-to-leaf path, ordered by depth and padded with -1."""
    is_parent = (ancestors.sum(0) - 1) > 0  # a node is someone's ancestor other than itself
    leaves = torch.nonzero(~is_parent).squeeze(-1)
    paths = torch.full((leaves.shape[0], int(depth.max()) + 1), -1, dtype=torch.long, device=ancestors.device)
    rows, nodes = torch.nonzero(ancestors[leaves], as_tuple=True)
    paths[rows, depth[nodes]] = nodes
    return paths


# --- static (Medusa-style) trees ------------------------------------------------------------------------

@dataclass(frozen=True)
class StaticTree:
    """A tree fixed in advance as paths of top-k choices (Medusa's `medusa_choices`).

    `choices[i]` is the rank (0 = most likely) of node i's token in its depth's head distribution; node 0
    is the root, whose token comes from the target.
    """

    name: str
    paths: tuple[tuple[int, ...], ...]
    parents: torch.Tensor  # (N,)
    depth: torch.Tensor  # (N,)
    choices: torch.Tensor  # (N,) rank of each node's token among its head's top-k (root: 0)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def max_choice(self) -> int:
        return int(self.choices.max()) + 1


def static_tree_from_paths(paths: list[list[int]] | list[tuple[int, ...]], name: str = "custom") -> StaticTree:
    """Build a static tree from Medusa-style paths, e.g. [[0], [1], [0, 0], [0, 1]].

    Every prefix of a path must itself be a path (so every node has its parent). Nodes are ordered by
    depth, then lexicographically, which keeps parents before children.
    """
    unique = sorted({tuple(int(c) for c in p) for p in paths}, key=lambda p: (len(p), p))
    if not unique or any(len(p) == 0 for p in unique):
        raise ValueError(f"static tree {name!r}: paths must be non-empty lists of ranks, got {paths!r}")
    if any(c < 0 for p in unique for c in p):
        raise ValueError(f"static tree {name!r}: ranks must be >= 0, got {paths!r}")
    index = {(): 0}
    parents, depth, choices = [-1], [0], [0]
    for p in unique:
        if p[:-1] not in index:
            raise ValueError(f"static tree {name!r}: path {list(p)} has no parent path {list(p[:-1])}")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        depth.append(len(p))
        choices.append(p[-1])
    return StaticTree(name, tuple(unique), torch.tensor(parents), torch.tensor(depth), torch.tensor(choices))


def truncate_static_tree(tree: StaticTree, max_depth: int) -> StaticTree:
    """The same tree without the paths deeper than `max_depth` (for Medusa checkpoints with fewer heads)."""
    return static_tree_from_paths([p for p in tree.paths if len(p) <= max_depth], name=f"{tree.name}@depth{max_depth}")


def chain_tree(depth: int) -> StaticTree:
    """A chain of `depth` draft tokens (classic speculative decoding)."""
    return static_tree_from_paths([[0] * d for d in range(1, depth + 1)], name=f"chain{depth}")


def load_static_tree(name_or_path: str) -> StaticTree:
    """Load a static tree from a YAML file (`paths: [[0], [1], [0, 0], ...]`), a name under configs/trees/, or
    'chain<depth>' (`chain_tree`)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text, name = path.read_text(), path.stem
    else:
        trees = resources.files("specheads.configs") / "trees"
        candidate = trees / f"{name_or_path}.yaml"
        chain = re.fullmatch(r"chain([1-9][0-9]*)", name_or_path)
        if chain and not candidate.is_file():
            return chain_tree(int(chain.group(1)))  # 'chain<depth>': any depth
        if not candidate.is_file():
            known = sorted(p.name.removesuffix(".yaml") for p in trees.iterdir() if p.name.endswith(".yaml"))
            raise ValueError(f"static tree {name_or_path!r} not found; expected a YAML path or one of {known}")
        text, name = candidate.read_text(), name_or_path
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or "paths" not in data:
        raise ValueError(f"static tree {name_or_path!r}: expected a mapping with a 'paths' list")
    return static_tree_from_paths(data["paths"], name=name)


def parse_eagle_tree(spec: str) -> dict[str, Any]:
    """'depth,top_k,nodes[,stop_prob[,min_prob]]' -> `SpeculativeLM.configure_tree` keyword arguments: the whole
    tree, so stop_prob and min_prob left out are 0 (no pruning), not the heads' default (on a CPU that is their
    `cpu_tree`'s, tuned for another shape: `--tree 8,10,60` would have been pruned there and not on a GPU)."""
    parts = spec.split(",")
    try:
        if not 3 <= len(parts) <= 5:
            raise ValueError
        values: dict[str, Any] = {"tree_depth": int(parts[0]), "tree_top_k": int(parts[1]), "tree_num_nodes": int(parts[2]),
                                  "tree_stop_prob": 0.0, "tree_min_prob": 0.0}
        for name, text in zip(("tree_stop_prob", "tree_min_prob"), parts[3:]):
            values[name] = float(text)
    except ValueError:
        raise ValueError(
            f"--tree {spec!r}: expected depth,top_k,nodes[,stop_prob[,min_prob]] (e.g. 5,8,24 or 6,6,16,0.05,0.03)"
        ) from None
    return values


def tree_options(spec: str) -> dict[str, Any]:
    """`SpeculativeLM.configure_tree` keywords of a command line's `--tree`: depth,top_k,nodes[,stop_prob[,min_prob]]
    (EAGLE heads' dynamic tree) or a static tree's name or path (Medusa heads)."""
    return parse_eagle_tree(spec) if "," in spec else {"tree": spec}


def tree_spec(description: dict[str, Any]) -> str:
    """A `SpeculativeLM.tree_description()` as the `--tree` value that gives that tree (a static tree's name, or
    depth,top_k,nodes,stop_prob,min_prob), with the prompt-lookup branch after it: what a command prints it uses."""
    if description["kind"] == "static":
        spec = description["name"]
    elif description["kind"] == "custom":
        spec = f"custom drafter {description['drafter']}"
    else:
        spec = ",".join(f"{description[key]:g}" for key in ("depth", "top_k", "nodes", "stop_prob", "min_prob"))
    if description.get("parallel"):
        spec += " (parallel drafting)"
    if description.get("block"):
        spec += " (block drafting)"
    lookup = description.get("lookup_tokens", 0)
    if lookup:
        grows = description.get("lookup_max_tokens")
        spec += f" + prompt lookup {lookup}" + (f" -> {grows}" if grows and grows != lookup else "") + " tokens"
    return spec
