"""Islands: a partition of the TP ranks into groups with cheap links inside (a PCIe switch, a socket).

The hierarchical schedule reduces inside each island, exchanges island partials between islands, and
sums them in island order. Islands come from the topology (host_topology.derive_islands) or from
`--allreduce-islands`, e.g. "0,1,2,3;4,5,6,7" (ranks, `;` between islands; sizes may differ).

Exchange rule (what island_plan encodes): rank y receives island X's partial from X's member at index
(index of y in its own island) mod |X|; so every rank receives exactly one partial per other island,
and a member of a small island may send to several ranks of a larger one.
"""

from __future__ import annotations

Islands = tuple[tuple[int, ...], ...]
NO_ISLAND = -2  # plan order entry past the last island
OWN = -1  # plan order entry of the rank's own island


def parse_islands(text: str, world_size: int) -> Islands:
    """'0,1,2,3;4,5,6,7' -> ((0, 1, 2, 3), (4, 5, 6, 7)). Raises ValueError naming the problem."""
    try:
        islands = tuple(
            tuple(int(r) for r in part.split(",") if r.strip()) for part in text.split(";") if part.strip()
        )
    except ValueError:
        raise ValueError(
            f"--allreduce-islands {text!r}: expected ranks separated by ',' and islands by ';', "
            "e.g. '0,1,2,3;4,5,6,7'"
        ) from None
    return validate_islands(islands, world_size, f"--allreduce-islands {text!r}")


def validate_islands(islands, world_size: int, what: str = "islands") -> Islands:
    """islands as a tuple of tuples after checking they partition range(world_size)."""
    islands = tuple(tuple(int(r) for r in island) for island in islands)
    flat = [r for island in islands for r in island]
    if any(not island for island in islands):
        raise ValueError(f"{what}: an island is empty")
    if sorted(flat) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(flat))
        repeated = sorted({r for r in flat if flat.count(r) > 1})
        outside = sorted(r for r in set(flat) if not 0 <= r < world_size)
        raise ValueError(
            f"{what} must list every rank 0..{world_size - 1} exactly once"
            + (f"; missing {missing}" if missing else "")
            + (f"; repeated {repeated}" if repeated else "")
            + (f"; out of range {outside}" if outside else "")
        )
    return islands


def format_islands(islands: Islands) -> str:
    return ";".join(",".join(str(r) for r in island) for island in islands)


def exchange_source(islands: Islands, receiver: int, island: tuple[int, ...]) -> int:
    """The member of `island` that sends its partial to `receiver` (in another island)."""
    own = next(i for i in islands if receiver in i)
    return island[own.index(receiver) % len(island)]


def island_plan(islands: Islands, rank: int, world_size: int) -> list[int]:
    """The hierarchical kernel's plan table for `rank`: [island mask, send mask, receive mask,
    then per island in order the rank its partial comes from (OWN for rank's island), NO_ISLAND past the
    last], world_size + 3 int32 values."""
    own = next(i for i in islands if rank in i)
    island_mask = sum(1 << r for r in own)
    send = sum(
        1 << y
        for other in islands
        if other is not own
        for y in other
        if exchange_source(islands, y, own) == rank
    )
    order = [OWN if island is own else exchange_source(islands, rank, island) for island in islands]
    receive = sum(1 << r for r in order if r >= 0)
    return [island_mask, send, receive, *order, *[NO_ISLAND] * (world_size - len(islands))]
