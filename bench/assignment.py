"""What assigning records to chunks by a hash of their id costs and buys, at the seed's scale.

37,312 records with the merge benchmark's lengths (lognormal around ~2,350 tokens, at most
8,192) in 512 chunks, two assignments:

* hash (what split_chunks does): chunk = sha256(id)[:8] mod n_chunks;
* greedy (the baseline, what split_chunks did before): longest record first onto the
  least-loaded chunk, over the shuffled merge order.

Costs: the heaviest chunk's tokens over the mean (the slowest chunk of a parallel run).
Buys: how many chunks change (so are re-extracted) when k records are removed.

Usage: .venv/bin/python bench/assignment.py [--records 37312] [--chunks 512]
Last line: ``hash/greedy chunks re-extracted after 10 removals: X / Y``.
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np

from hsextract.records import id_hash


def greedy(tokens: list[int], n: int) -> list[int]:
    heap = [(0, c) for c in range(n)]
    where = [0] * len(tokens)
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, c = heapq.heappop(heap)
        where[i] = c
        heapq.heappush(heap, (load + tokens[i], c))
    return where


def members(where: list[int], ids: list[str], n: int) -> list[frozenset[str]]:
    out: list[set[str]] = [set() for _ in range(n)]
    for rid, c in zip(ids, where, strict=True):
        out[c].add(rid)
    return [frozenset(m) for m in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=37_312)
    ap.add_argument("--chunks", type=int, default=512)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1900), 0.65, args.records), 16, 8192).astype(int)
    ids = [f"rec-{i:06d}" for i in range(args.records)]
    n = args.chunks

    def assign(kind: str, keep: np.ndarray) -> list[frozenset[str]]:
        kept = [ids[i] for i in np.flatnonzero(keep)]
        if kind == "hash":
            return members([id_hash(r) % n for r in kept], kept, n)
        order = rng_order[keep[rng_order]]  # the merge's shuffled order of what is kept
        toks = [int(lengths[i]) for i in order]
        return members(greedy(toks, n), [ids[i] for i in order], n)

    rng_order = np.random.default_rng(1).permutation(args.records)
    everything = np.ones(args.records, bool)
    for kind in ("hash", "greedy"):
        chunks = assign(kind, everything)
        load = np.array([sum(int(lengths[int(r[4:])]) for r in c) for c in chunks])
        print(
            f"{kind:>6}: tokens per chunk mean {load.mean():,.0f}, max/mean "
            f"{load.max() / load.mean():.3f}, min/mean {load.min() / load.mean():.3f}, "
            f"std/mean {load.std() / load.mean():.3f}"
        )
    changed = {}
    for k in (1, 10, 100):
        drop = everything.copy()
        drop[np.random.default_rng(k).choice(args.records, k, replace=False)] = False
        for kind in ("hash", "greedy"):
            before, after = assign(kind, everything), assign(kind, drop)
            changed[kind, k] = sum(a != b for a, b in zip(before, after, strict=True))
        print(
            f"remove {k:>3} records: chunks re-extracted hash {changed['hash', k]:>4}, "
            f"greedy {changed['greedy', k]:>4} (of {n})"
        )
    print(
        f"hash/greedy chunks re-extracted after 10 removals: "
        f"{changed['hash', 10]} / {changed['greedy', 10]}"
    )


if __name__ == "__main__":
    main()
