"""Outputs in the records layout before issue 18 (``keys.json``, ``stats.json``, ``rejects/*.json``,
``failed_inputs/*.json``), made from a current output by renaming, as the old code named them."""

from diffusion.convert.sink import INDEX_JSON, STATS_RECORD


def to_old_layout(out, half_done_part=None):
    """Rename every record below ``out`` to its old ``.json`` name; ``half_done_part``: a part left with
    its stats already renamed back, as a run killed while migrating leaves it."""
    for path in sorted(out.rglob("*.jsonl")):
        path.rename(path.with_suffix(".json"))
    if half_done_part is not None:
        (out / half_done_part / "stats.json").rename(out / half_done_part / STATS_RECORD)


def records_named_json(out) -> list[str]:
    """Files below the root named *.json other than the parts' index.json: what streaming's
    merge_index(root) would take for a part's index."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.json") if p.parent != out and p.name != INDEX_JSON)
