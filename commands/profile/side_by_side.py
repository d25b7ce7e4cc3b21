"""A token profile's whole images as one table users can read: the usual loops on the same weights
(``--baselines``) and FastAR's decoders, with each row's speed-up over each usual loop. Printed by ``profile`` and
written into the GPU check's report."""
from __future__ import annotations

COLUMNS = ("loop", "same images as plain sampling", "s per call", "forwards per call", "ms per forward",
           "x the floor")


def side_by_side(entry: dict, lossless: dict[str, bool]) -> list[str]:
    """Markdown lines of one batch's table (``entry``: a batch of a profile report); none without baselines.
    ``lossless``: per decoder row of ``entry["decoders"]``, whether it draws exactly what plain sampling draws."""
    baselines, decoders = entry.get("baselines", {}), entry.get("decoders", {})
    if not baselines:
        return []
    header = [*COLUMNS, *(f"x faster than {name}" for name in baselines)]
    rows = [row(name, "yes", cost, baselines) for name, cost in baselines.items()]
    rows += [row(f"FastAR {name}", "yes" if lossless[name] else "no (relaxed)", cost, baselines)
             for name, cost in decoders.items()]
    return [as_line(header), as_line(["---"] * len(header)), *map(as_line, rows)]


def row(name: str, exact: str, cost: dict, baselines: dict) -> list[str]:
    return [name, exact, f"{cost['image_s']:.3f}", f"{cost['target_forwards']:.0f}", f"{cost['ms_per_iteration']:.2f}",
            f"{cost['over_floor']:.2f}", *(f"{b['image_s'] / cost['image_s']:.2f}" for b in baselines.values())]


def as_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"

