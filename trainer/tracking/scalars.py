"""The trainer's records as tracker scalars: what every sink (trainer/tracking/trackers.py,
trainer/tracking/tensorboard.py) logs."""

from __future__ import annotations

Scalars = dict[str, int | float]
Steps = list[tuple[int, Scalars]]


def scalars(record: dict, prefix: str = "") -> Scalars:
    """A record's numeric fields by their JSONL names: bools as 0/1, nested dicts as `outer/inner`;
    lists, strings and None are left out."""
    out: Scalars = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, int | float):
            out[name] = value
    return out


def summary_step(summary: dict) -> int:
    """The step a run summary is logged at: the run's last step (0 for a run that took none)."""
    return summary.get("last_step") or 0
