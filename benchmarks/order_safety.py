"""How many generated orders are unsafe under NCCL's rules, over a grid of families x sizes x links.

Run: ``python -m benchmarks.order_safety`` (prints one line per unsafe order and the count).

Every family's order for p in {2, 3, 4, 8} ranks and several microbatch counts is
lowered for a plain chain and for a chain plus skip links (0 -> last stage with a
gradient, 0 -> S/2+1 without), then checked by ``validate``: on every channel the
same messages in the same order at both ends, and no deadlock when a batch waits
for its counterparts.
"""

from __future__ import annotations

import argparse
from typing import Iterator

from pippy_split.schedule.deps import Link, chain_links
from pippy_split.schedule.lower import lower
from pippy_split.schedule.orders import ORDERS
from pippy_split.schedule.placement import stage_to_rank
from pippy_split.schedule.validate import validate

RANKS = (2, 3, 4, 8)


def grid() -> Iterator[tuple[str, int, int, bool, list[Link]]]:
    """(family, ranks, microbatches, with skips, links) for every case of the grid."""
    for name, spec in ORDERS.items():
        per_rank = spec.default_stages_per_rank()
        for p in RANKS:
            num_stages = p * per_rank
            for m in sorted({p, 2 * p, p + 1, 4, 3 * p}):
                for skips in (False, True):
                    links = chain_links(num_stages)
                    if skips:
                        links = links + [(0, num_stages - 1, True)]
                        mid = num_stages // 2 + 1
                        if 1 < mid < num_stages - 1:
                            links.append((0, mid, False))
                    yield name, p, m, skips, links


def unsafe_orders() -> tuple[list[str], int]:
    """Descriptions of the unsafe cases, and how many cases were checked."""
    bad, total = [], 0
    for name, p, m, skips, links in grid():
        spec = ORDERS[name]
        per_rank = spec.default_stages_per_rank()
        num_stages = p * per_rank
        placement = stage_to_rank(num_stages, p, spec.placement)
        try:
            order = spec.compute_order(p, m, per_rank)
        except ValueError:  # the family refuses this size (e.g. DualPipeV needs m >= 2p - 1)
            continue
        total += 1
        try:
            validate(lower(order, links, placement), num_stages, m, links=links, placement=placement)
        except Exception as e:  # noqa: BLE001 - every failure is a finding to print
            bad.append(f"{name} p={p} m={m} skips={skips}: {type(e).__name__}: {str(e).splitlines()[0]}")
    return bad, total


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    bad, total = unsafe_orders()
    for line in bad:
        print(line)
    print(f"{len(bad)} unsafe of {total} lowered orders")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
