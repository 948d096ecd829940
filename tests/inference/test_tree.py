"""Tree buffers and static trees: pure functions, checked against slow pure-Python references (no model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specheads.inference.tree import (
    build_tree_buffers,
    chain_tree,
    load_static_tree,
    static_tree_from_paths,
    tree_options,
    tree_spec,
    truncate_static_tree,
)


@st.composite
def random_parents(draw, max_nodes: int = 40) -> list[int]:
    """A valid tree in topological order: parents[0] = -1, parents[i] uniform in [0, i)."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def chain_to_root(parents: list[int], node: int) -> list[int]:
    """[node, parent, grandparent, ..., 0]: the slow reference for ancestry."""
    chain = [node]
    while parents[chain[-1]] != -1:
        chain.append(parents[chain[-1]])
    return chain


@given(random_parents())
@settings(max_examples=150, deadline=None)
def test_ancestors_depth_and_mask_match_a_slow_reference(parents):
    """Each node sees exactly itself and its ancestors; depth is the chain length; the bias is 0 / finfo.min."""
    tree = build_tree_buffers(torch.tensor(parents))
    n = len(parents)
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        expected[i, chain_to_root(parents, i)] = True
    assert torch.equal(tree.ancestors, expected)
    assert tree.depth.tolist() == [len(chain_to_root(parents, i)) - 1 for i in range(n)]
    assert tree.parents.tolist() == parents
    assert tree.num_nodes == n
    assert tree.attention_bias.dtype == torch.float32
    assert bool((tree.attention_bias[expected] == 0).all())
    assert bool((tree.attention_bias[~expected] == torch.finfo(torch.float32).min).all())
    # A depth bound (fixed passes, no host sync: what CUDA-graph drafting uses) gives the same buffers.
    bounded = build_tree_buffers(torch.tensor(parents), check=False, max_depth=max(tree.depth.tolist()) + 1)
    assert torch.equal(bounded.ancestors, expected) and torch.equal(bounded.depth, tree.depth)


@given(random_parents())
@settings(max_examples=150, deadline=None)
def test_retrieve_indices_are_exactly_the_root_to_leaf_paths(parents):
    """One row per leaf: the nodes from the root down to that leaf, in depth order, padded with -1."""
    tree = build_tree_buffers(torch.tensor(parents))
    n = len(parents)
    leaves = [i for i in range(n) if i not in parents]
    max_depth = max(len(chain_to_root(parents, i)) for i in range(n)) - 1
    expected = sorted(
        tuple(chain_to_root(parents, leaf)[::-1] + [-1] * (max_depth + 1 - len(chain_to_root(parents, leaf))))
        for leaf in leaves
    )
    assert tree.retrieve_indices.shape == (len(leaves), max_depth + 1)
    assert tree.retrieve_indices.dtype == torch.long
    assert sorted(tuple(row) for row in tree.retrieve_indices.tolist()) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_attention_bias_uses_the_requested_dtype(dtype):
    """The bias is built in the target's dtype with that dtype's most negative value off the ancestors."""
    tree = build_tree_buffers(torch.tensor([-1, 0, 0, 1]), dtype=dtype)
    assert tree.attention_bias.dtype == dtype
    assert tree.attention_bias[3].tolist() == [0, 0, torch.finfo(dtype).min, 0]


def test_single_root_tree():
    """A lone root is a valid tree: depth 0, one path [0]."""
    tree = build_tree_buffers(torch.tensor([-1]))
    assert tree.depth.tolist() == [0]
    assert tree.retrieve_indices.tolist() == [[0]]
    assert tree.attention_bias.tolist() == [[0.0]]


@pytest.mark.parametrize(
    "parents",
    [
        [],  # empty
        [0, 0],  # root with a parent
        [-1, 1],  # self-parent
        [-1, 0, 3, 1],  # parent after child (not topological)
        [-1, -1],  # two roots
        [-1, 0, -2],  # negative parent
    ],
)
def test_invalid_parents_raise_value_error_naming_them(parents):
    """Bad parent arrays are rejected with a ValueError that shows the array."""
    with pytest.raises(ValueError, match="parents"):
        build_tree_buffers(torch.tensor(parents, dtype=torch.long))


def test_two_dimensional_parents_raise_value_error():
    with pytest.raises(ValueError, match="1-D"):
        build_tree_buffers(torch.tensor([[-1, 0]]))


# --- static trees ---------------------------------------------------------------------------------------
def check_static_tree_consistent(tree) -> None:
    """Each path's node has the node of the path minus its last rank as parent, its length as depth."""
    node_of = {(): 0}
    for node, path in enumerate(sorted(tree.paths, key=lambda p: (len(p), p)), start=1):
        node_of[path] = node
    assert len(node_of) == tree.parents.shape[0]
    for path, node in node_of.items():
        if not path:
            assert tree.parents[0] == -1 and tree.depth[0] == 0
            continue
        assert int(tree.parents[node]) == node_of[path[:-1]]
        assert int(tree.depth[node]) == len(path)
        assert int(tree.choices[node]) == path[-1]
    buffers = build_tree_buffers(tree.parents)  # the static shape is a valid tree
    assert torch.equal(buffers.depth, tree.depth)


@pytest.mark.parametrize(
    ("name", "nodes", "max_depth", "max_choice", "leaves"),
    [("medusa_default", 28, 5, 4, 14), ("medusa_small", 8, 4, 2, 3)],
)
def test_shipped_static_trees(name, nodes, max_depth, max_choice, leaves):
    """The YAML trees under configs/trees/ load with the documented sizes (root + paths)."""
    tree = load_static_tree(name)
    assert tree.name == name
    assert tree.parents.shape == tree.depth.shape == tree.choices.shape == (nodes,)
    assert tree.max_depth == max_depth
    assert tree.max_choice == max_choice
    assert build_tree_buffers(tree.parents).retrieve_indices.shape == (leaves, max_depth + 1)
    check_static_tree_consistent(tree)


def test_static_tree_from_paths_orders_by_depth_then_rank_and_dedupes():
    """Paths may come in any order and repeat; nodes come out by depth then lexicographically."""
    tree = static_tree_from_paths([[1, 0], [0], [1], [0, 1], [0], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.choices.tolist() == [0, 0, 1, 0, 1, 0]
    check_static_tree_consistent(tree)


@pytest.mark.parametrize(
    ("paths", "match"),
    [
        ([[0], [0, 0, 1]], r"no parent path \[0, 0\]"),
        ([[1, 0]], r"no parent path \[1\]"),
        ([], "non-empty"),
        ([[0], []], "non-empty"),
        ([[0], [-1]], ">= 0"),
    ],
)
def test_bad_static_paths_raise_value_error(paths, match):
    """A path without its parent path, an empty path or a negative rank is a ValueError saying which."""
    with pytest.raises(ValueError, match=match):
        static_tree_from_paths(paths)


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_chain_tree(depth):
    """chain_tree(d): the root then d top-1 tokens, each the child of the previous one."""
    tree = chain_tree(depth)
    assert tree.parents.tolist() == [-1, *range(depth)]
    assert tree.depth.tolist() == list(range(depth + 1))
    assert tree.choices.tolist() == [0] * (depth + 1)
    assert tree.max_depth == depth and tree.max_choice == 1
    assert build_tree_buffers(tree.parents).retrieve_indices.tolist() == [list(range(depth + 1))]


@pytest.mark.parametrize("max_depth", [1, 3, 5, 9])
def test_truncate_static_tree_keeps_the_shallow_paths(max_depth):
    """Cutting medusa_default at depth d keeps exactly its paths of length <= d, as a valid tree."""
    full = load_static_tree("medusa_default")
    cut = truncate_static_tree(full, max_depth)
    assert cut.paths == tuple(p for p in full.paths if len(p) <= max_depth)
    assert cut.max_depth == min(max_depth, full.max_depth)
    check_static_tree_consistent(cut)


def test_load_static_tree_from_a_yaml_file(tmp_path):
    """A YAML path works as well as a shipped name; the file stem becomes the tree's name."""
    path = tmp_path / "mine.yaml"
    path.write_text("paths:\n  - [0]\n  - [1]\n  - [0, 0]\n")
    tree = load_static_tree(str(path))
    assert tree.name == "mine"
    assert tree.parents.tolist() == [-1, 0, 0, 1]


def test_load_static_tree_errors_name_the_tree(tmp_path):
    """An unknown name lists the shipped trees; a YAML without `paths` says so."""
    with pytest.raises(ValueError, match="no_such_tree.*medusa_default"):
        load_static_tree("no_such_tree")
    path = tmp_path / "bad.yaml"
    path.write_text("nodes: [1, 2]\n")
    with pytest.raises(ValueError, match="paths"):
        load_static_tree(str(path))


def test_tree_spec_is_the_tree_option_that_gives_the_tree():
    """`tree_spec` writes a tree description as `--tree` takes it (and the lookup branch after it)."""
    dynamic = {"kind": "dynamic", "depth": 4, "top_k": 4, "nodes": 8, "stop_prob": 0.2, "min_prob": 0.03,
               "lookup_tokens": 0}
    assert tree_spec(dynamic) == "4,4,8,0.2,0.03"
    assert tree_options(tree_spec(dynamic)) == {"tree_depth": 4, "tree_top_k": 4, "tree_num_nodes": 8,
                                                "tree_stop_prob": 0.2, "tree_min_prob": 0.03}
    looked_up = {**dynamic, "lookup_tokens": 10, "lookup_max_tokens": 40}
    assert tree_spec(looked_up) == "4,4,8,0.2,0.03 + prompt lookup 10 -> 40 tokens"
    assert tree_spec({**looked_up, "lookup_max_tokens": None}) == "4,4,8,0.2,0.03 + prompt lookup 10 tokens"
    assert tree_spec({"kind": "static", "name": "medusa_small", "nodes": 20, "depth": 3, "lookup_tokens": 0}) == \
        "medusa_small"
