r"""One token tree per step: the drafts of every source merged into a trie under a node budget.

A draft is a small tree of its own (a suffix match or a pool n-gram is a chain; a recycled expansion is
a real tree), given as flat arrays over all drafts: ``tokens``, ``parents`` (index of an earlier node of
the same arrays, -1 = child of the current token), ``scores`` (estimated probability that the node is
accepted; never above its parent's) and ``sources`` (a bit per source that proposed it). Merging keeps one
node per distinct path (shared prefixes become one row, its score the best, raised where the recycling table
and another source agree, its sources the union); the
budget keeps the ``budget`` best nodes. Because a node never outscores its parent, the best nodes always
form a tree. The result lists it depth first, each node's children in score order, so a parent comes before
its children and the chain of best children right after the current token (an accepted path along it keeps
its KV where the step wrote it: no move in ``kv.BatchCache.compact``):

    drafts:  suffix  c -> 7 9 4        merged:        c              node  token parent depth
             pool    c -> 7 9 5                       |                0     7     -1     1
             recycle c -> 7 2, c -> 3               7   3              1     9      0     2
                                                   / \                 2     4      1     3
                                                  9   2                3     5      1     3
                                                 / \                   4     2      0     2
                                                4   5                  5     3     -1     1

The expected number of accepted tokens of a tree is the sum of its nodes' scores, which is what lets a
cost model size the tree (``expected_accepted``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

NO_PARENT = -1


NO_RATES = np.empty(0)  # no agreement rescoring (``merge_drafts``: an explicit argument, since numba's on-disk cache
                       # misses on a default array: a process that used one compiled the kernel anew, ~3 s)


@njit(cache=True)
def merge_drafts(
    tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, sources: np.ndarray, budget: int, agree_bit: int,
    agree_rates: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge drafts into a trie and keep its ``budget`` best nodes.

    Inputs are (M,) arrays (tokens int, parents int with parent < own index, scores float64, sources int).
    A node proposed by source ``agree_bit`` (0: none) and by another is rescored: its conditional rate (its score over
    its parent's) rises to ``agree_rates[depth - 1]`` (the last one deeper) where that is higher, and its
    descendants' scores follow.
    Returns the kept nodes, depth first, as ``TokenTree``'s fields: tokens, parents (indices into them, -1 = the
    current token), depths, scores, source bits (K,) each. Raises ValueError on a bad parent index, a negative budget,
    or a score above its parent's or NaN (the best nodes would not be a tree: a kept node whose parent was not is no
    row of a step).
    """
    if budget < 0:
        raise ValueError("budget must be >= 0, got " + str(budget))
    m = tokens.size
    trie_token = np.empty(m, np.int64)
    trie_parent = np.empty(m, np.int64)
    trie_score = np.empty(m, np.float64)
    trie_source = np.zeros(m, np.int64)
    trie_depth = np.empty(m, np.int64)
    node_of = np.empty(m, np.int64)
    size = 0
    # 1. merge: each draft node maps to the trie node with the same parent and token (created if new)
    for i in range(m):
        p = parents[i]
        if p >= i or p < NO_PARENT:
            raise ValueError("draft node " + str(i) + " has parent " + str(p) + ", not an earlier node or -1")
        if tokens[i] < 0:
            node_of[i] = -2  # a missing token (an empty table slot): it and its descendants are dropped
            continue
        parent = NO_PARENT if p == NO_PARENT else node_of[p]
        if parent == -2:
            node_of[i] = -2
            continue
        found = -1
        for j in range(size):
            if trie_parent[j] == parent and trie_token[j] == tokens[i]:
                found = j
                break
        if found < 0:
            found = size
            size += 1
            trie_token[found] = tokens[i]
            trie_parent[found] = parent
            trie_score[found] = scores[i]
            trie_depth[found] = 1 if parent == NO_PARENT else trie_depth[parent] + 1
        elif scores[i] > trie_score[found]:
            trie_score[found] = scores[i]
        trie_source[found] |= sources[i]
        node_of[i] = found
    # 2. agreement: two sources that draft independently are far likelier right together than either says
    #    (SmolLM2, fixed shape: the recycling table's nodes 0.07 alone, 0.45-0.53 with a pool or suffix draft)
    if agree_rates.size:
        merged = trie_score[:size].copy()  # a node's conditional rate: merged[node] / merged[parent]
        for j in range(size):  # parents before children
            p = trie_parent[j]
            above, below = (1.0, 1.0) if p == NO_PARENT else (trie_score[p], merged[p])
            rate = merged[j] / below if below > 0 else 0.0
            if trie_source[j] & agree_bit and trie_source[j] & ~agree_bit:
                rate = max(rate, agree_rates[min(trie_depth[j], agree_rates.size) - 1])
            trie_score[j] = rate * above
    for j in range(size):  # drafts' scores never rise along a branch, so neither do the merged ones (nor agreement's)
        above = 1.0 if trie_parent[j] == NO_PARENT else trie_score[trie_parent[j]]
        if not trie_score[j] <= above or not trie_score[j] >= 0.0:
            raise ValueError("merged node " + str(j) + "'s score is not in [0, its parent's score] (a child of the current "
                             "token's: [0, 1]); scores are probabilities that never rise along a branch")
    # 3. keep the best nodes: score descending, then shallower first, so a parent always precedes its children
    order = np.argsort(-trie_score[:size] + 1e-9 * trie_depth[:size], kind="mergesort")
    keep = order[: min(budget, size)]
    # 4. lay them out depth first, each node's children in score order: a parent before its children, and the
    #    chain of best children right after the current token (an accepted path along it keeps its KV in place)
    first_child = np.full(size + 1, -1, np.int64)  # per trie node, and at ``size`` the current token
    next_sibling = np.full(size, -1, np.int64)
    for k in range(keep.size - 1, -1, -1):  # in reverse score order, each node goes in front of its siblings
        j = keep[k]
        p = size if trie_parent[j] == NO_PARENT else trie_parent[j]
        next_sibling[j], first_child[p] = first_child[p], j
    laid = np.empty(keep.size, np.int64)
    node, k = first_child[size], 0
    while node >= 0:
        laid[k] = node
        k += 1
        if first_child[node] >= 0:
            node = first_child[node]
            continue
        while node >= 0 and next_sibling[node] < 0:
            node = trie_parent[node]
        if node >= 0:
            node = next_sibling[node]
    keep = laid
    index = np.full(size, NO_PARENT, np.int64)
    out_parent = np.empty(keep.size, np.int64)
    for k in range(keep.size):
        j = keep[k]
        index[j] = k
        out_parent[k] = NO_PARENT if trie_parent[j] == NO_PARENT else index[trie_parent[j]]
    return trie_token[keep], out_parent, trie_depth[keep], trie_score[keep], trie_source[keep]


@njit(cache=True)
def draft_rows(chains: np.ndarray, chain_rows: np.ndarray, chain_bits: np.ndarray, rates: np.ndarray, tree_tokens: np.ndarray,
               tree_parents: np.ndarray, tree_scores: np.ndarray, tree_bit: int, agree_rates: np.ndarray, budget: int,
               max_depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every source's drafts merged in one call (``merge_drafts``' tree): ``chains`` (C, L) of token ids, -1 after
    a chain's end (pool n-grams, suffix matches), each node scored with the product of its chain's conditional
    acceptance rates ``rates[chain_rows[c], depth]`` down to its depth and cut at ``max_depth``; and one tree
    already scored (a recycling expansion: tokens, parents, scores, all proposed by ``tree_bit``; where a chain
    proposes one of its nodes too, ``agree_rates`` rescore it: ``merge_drafts``). One kernel,
    not a dozen numpy calls a sequence: they were most of a batch's drafting time. (Numba's cache tracks this
    file only: a kernel here calls no kernel of another file.)"""
    c, length = chains.shape[0], min(chains.shape[1], max_depth)
    m = c * length + tree_tokens.size
    tokens, parents = np.empty(m, np.int64), np.empty(m, np.int64)
    scores, sources = np.empty(m, np.float64), np.empty(m, np.int64)
    i = 0
    for a in range(c):
        score = 1.0
        for j in range(length):
            score *= rates[chain_rows[a], min(j, rates.shape[1] - 1)]
            tokens[i], parents[i], scores[i], sources[i] = chains[a, j], -1 if j == 0 else i - 1, score, chain_bits[a]
            i += 1
    for t in range(tree_tokens.size):
        tokens[i + t], scores[i + t], sources[i + t] = tree_tokens[t], tree_scores[t], tree_bit
        parents[i + t] = -1 if tree_parents[t] < 0 else tree_parents[t] + i
    return merge_drafts(tokens, parents, scores, sources, budget, tree_bit, agree_rates)


@njit(cache=True)
def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """(K, K) bool: node i may attend to node j iff j is i or one of its ancestors (parents before children)."""
    k = parents.size
    seen = np.zeros((k, k), np.bool_)
    for i in range(k):
        if parents[i] >= 0:
            seen[i] = seen[parents[i]]
        seen[i, i] = True
    return seen


@dataclass(frozen=True, eq=False)
class TokenTree:
    """The merged tree of one step (K nodes, parents before children)."""

    tokens: np.ndarray  # (K,) int64
    parents: np.ndarray  # (K,) int64, -1 = child of the current token
    depths: np.ndarray  # (K,) int64, 1 = child of the current token
    scores: np.ndarray  # (K,) float64, estimated probability of acceptance
    sources: np.ndarray  # (K,) int64, bit per source that proposed the node
    _warm = False  # a class attribute (unannotated, so not a field): kernels compiled in this process

    @classmethod
    def merge(cls, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, sources: np.ndarray, budget: int) -> "TokenTree":
        return cls(*merge_drafts(tokens, parents, scores, sources, budget, 0, NO_RATES))

    @classmethod
    def warm_up(cls) -> None:
        """Compile (or load from numba's on-disk cache) this module's kernels once per process, at load time:
        a fresh install's first request would otherwise spend seconds of its first step compiling them."""
        if not cls._warm:
            ancestor_matrix(cls.merge(np.zeros(1, np.int64), np.full(1, NO_PARENT, np.int64), np.ones(1), np.ones(1, np.int64), 1).parents)
            cls._warm = True

    @classmethod
    def empty(cls) -> "TokenTree":
        """The tree of no nodes (a plain step's), built once: its arrays have nothing to change."""
        return _EMPTY

    def __len__(self) -> int:
        return self.tokens.size

    def children(self, node: int) -> np.ndarray:
        """Indices of ``node``'s children (node -1: the current token's), best first."""
        return np.flatnonzero(self.parents == node)

    def path(self, node: int) -> list[int]:
        """Nodes from the top of the tree down to ``node`` (empty for -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def best(self, nodes: int) -> "TokenTree":
        """The ``nodes`` highest-scoring nodes (a tree, since no node outscores its parent)."""
        if nodes >= len(self):
            return self
        if nodes <= 0:
            return _EMPTY
        return TokenTree.merge(self.tokens, self.parents, self.scores, self.sources, nodes)


_EMPTY = TokenTree(*(np.empty(0, dtype) for dtype in (np.int64, np.int64, np.int64, np.float64, np.int64)))
