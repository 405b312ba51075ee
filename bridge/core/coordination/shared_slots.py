"""Free slots per queue when worker nodes consume several of the bridge's queues.

A node on queues A and B gives its slots to either, so a queue's room depends on where the other queues'
in-flight attempts can be placed: a maximum flow from queues (their demand) through node groups (the
queues each consumes) to the groups' slots. Groups, not nodes, are the vertices, which keeps the network to
a handful of vertices whatever the number of nodes.
"""

from __future__ import annotations


def rooms(groups: dict[frozenset[str], int], inflight: dict[str, int]) -> dict[str, int]:
    """Each queue's room: the extra flow its rollouts could push once every in-flight attempt is placed, or,
    negative, its in-flight attempts that no slot can hold."""
    base, placed = max_flow(groups, inflight)
    out: dict[str, int] = {}
    for queue, count in inflight.items():
        unplaced = count - placed.get(queue, 0)
        if unplaced > 0:
            out[queue] = -unplaced
            continue
        more = sum(groups.values()) + 1  # more than could ever be placed: the flow finds the real room
        total, _ = max_flow(groups, {**inflight, queue: count + more})
        out[queue] = total - base
    return out


def max_flow(groups: dict[frozenset[str], int], demand: dict[str, int]) -> tuple[int, dict[str, int]]:
    """Place ``demand`` (per queue) on node groups (capacity per group of the queues it consumes).

    Edmonds-Karp on source -> queue (its demand) -> group (unbounded, where the group consumes the
    queue) -> sink (the group's slots). Returns the total placed and how much of each queue was placed.
    """
    queues = [q for q in demand if demand[q] > 0]
    order = list(groups)
    src: object = ("s",)
    sink: object = ("t",)
    capacity_of: dict[tuple[object, object], int] = {}
    edges: dict[object, list[object]] = {src: [], sink: []}

    def add(a: object, b: object, cap: int) -> None:
        capacity_of[(a, b)] = capacity_of.get((a, b), 0) + cap
        capacity_of.setdefault((b, a), 0)
        edges.setdefault(a, []).append(b)
        edges.setdefault(b, []).append(a)

    unbounded = sum(groups.values()) + sum(demand.values()) + 1
    for q in queues:
        add(src, ("q", q), demand[q])
        for g in order:
            if q in g:
                add(("q", q), ("g", g), unbounded)
    for g in order:
        add(("g", g), sink, groups[g])
    total = 0
    while True:
        parent: dict[object, object] = {src: src}
        frontier: list[object] = [src]
        while frontier and sink not in parent:
            nxt: list[object] = []
            for a in frontier:
                for b in edges.get(a, []):
                    if b not in parent and capacity_of[(a, b)] > 0:
                        parent[b] = a
                        nxt.append(b)
            frontier = nxt
        if sink not in parent:
            break
        path: list[tuple[object, object]] = []
        node = sink
        while node != src:
            path.append((parent[node], node))
            node = parent[node]
        push = min(capacity_of[edge] for edge in path)
        for a, b in path:
            capacity_of[(a, b)] -= push
            capacity_of[(b, a)] += push
        total += push
    placed = {q: capacity_of[(("q", q), src)] for q in queues}
    return total, placed
