"""Small range checks shared by the config dataclasses' `__post_init__` methods.

Messages name the bare field; the loader rewrites field names into full dotted keys
(`lr` -> `actor.optim.lr`), so a message reads the same from Python and from YAML.
"""

from rlhf.errors import ConfigError


def require_min(obj, low: float, *names: str) -> None:
    """Raise ConfigError unless every named field of `obj` is at least `low`."""
    for name in names:
        value = getattr(obj, name)
        if value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}")


def require_range(obj, name: str, low: float, high: float, *, low_open: bool = False,
                  high_open: bool = False) -> None:
    """Raise ConfigError unless field `name` lies in the interval from `low` to `high`."""
    value = getattr(obj, name)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be in {interval}, got {value}")


def require_positive_or_none(obj, *names: str) -> None:
    """Raise ConfigError unless every named optional field is None or > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive (or null to turn it off), got {value}")


def require_placement(obj) -> None:
    """`placement` and `world_size` agree: separate needs world_size >= 1, colocated none."""
    if obj.placement == "separate" and obj.world_size is None:
        raise ConfigError("placement 'separate' needs world_size (the ranks of its own pool)")
    if obj.placement == "colocated" and obj.world_size is not None:
        raise ConfigError("world_size is only for placement 'separate'; a colocated role uses "
                          "trainer.nnodes * trainer.ranks_per_node ranks: remove world_size")
    if obj.world_size is not None:
        require_min(obj, 1, "world_size")
