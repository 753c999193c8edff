"""Small graph algorithms for the static plan: reachability, dominators, cycles.

Graphs here are ``dict[node, set[successor]]`` over string node names; they are tiny (tens of
nodes), so clarity wins over asymptotics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

__all__ = ["bfs_order", "cycle_nodes", "dominators", "nearest_common_dominator", "reachable"]


def bfs_order(succ: Mapping[str, Iterable[str]], entry: str) -> list[str]:
    """Nodes reachable from ``entry`` in BFS order, successors visited sorted (deterministic)."""
    seen = {entry}
    order = [entry]
    queue = deque([entry])
    while queue:
        n = queue.popleft()
        for m in sorted(succ.get(n, ())):
            if m not in seen:
                seen.add(m)
                order.append(m)
                queue.append(m)
    return order


def reachable(succ: Mapping[str, Iterable[str]], start: str) -> frozenset[str]:
    """Every node reachable from ``start`` in zero or more steps (``start`` included)."""
    return frozenset(bfs_order(succ, start))


def dominators(succ: Mapping[str, Iterable[str]], entry: str) -> dict[str, frozenset[str]]:
    """``dom[n]``: the nodes every path from ``entry`` to ``n`` passes through (``n`` included).

    Only nodes reachable from ``entry`` appear. Classic iterative data-flow formulation; it is
    exact on graphs with cycles.
    """
    order = bfs_order(succ, entry)
    pred: dict[str, set[str]] = {n: set() for n in order}
    for n in order:
        for m in succ.get(n, ()):  # a successor of a reachable node is reachable: in pred
            pred[m].add(n)
    everything = frozenset(order)
    dom: dict[str, frozenset[str]] = {n: everything for n in order}
    dom[entry] = frozenset({entry})
    changed = True
    while changed:
        changed = False
        for n in order[1:]:
            inter = frozenset.intersection(*(dom[p] for p in pred[n])) if pred[n] else everything
            new = inter | {n}
            if new != dom[n]:
                dom[n] = new
                changed = True
    return dom


def nearest_common_dominator(dom: Mapping[str, frozenset[str]], nodes: Iterable[str]) -> str:
    """The deepest node that dominates every node of ``nodes``.

    Dominators of one node form a chain, so the common ones do too; the deepest is the one
    with the most dominators of its own.
    """
    common = frozenset.intersection(*(dom[n] for n in nodes))
    return max(common, key=lambda d: (len(dom[d]), d))


def cycle_nodes(succ: Mapping[str, Iterable[str]]) -> frozenset[str]:
    """Nodes that lie on a cycle (a non-trivial strongly connected component or a self-loop)."""
    nodes = set(succ)
    for targets in succ.values():
        nodes.update(targets)
    reach = {n: reachable(succ, n) for n in nodes}
    on_cycle = set()
    for n in nodes:
        if n in succ.get(n, ()):
            on_cycle.add(n)
            continue
        for m in succ.get(n, ()):
            if n in reach[m]:
                on_cycle.add(n)
                break
    return frozenset(on_cycle)
