"""``RunConfig``: the tree of sections, read from TOML with ``--set`` overrides merged in."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tetrarec.config.convert import _fields_to_dict, config_from_dict
from tetrarec.config.model import ModelConfig
from tetrarec.config.optim import OptimConfig
from tetrarec.config.overrides import _field_type, _parse_text
from tetrarec.config.sharding import ShardingConfig
from tetrarec.config.train import TrainConfig
from tetrarec.data.config import DataConfig

__all__ = ["RunConfig"]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: ``data``, ``model``, ``optim``, ``train`` and ``sharding`` sections."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)

    def __post_init__(self) -> None:
        # Checked with the config, as model.placement's list is, not first under torchrun.
        types = self.sharding.type
        if isinstance(types, tuple) and len(types) != self.model.num_sparse:
            raise ValueError(
                f"sharding.type must be one sharding type or {self.model.num_sparse} (one "
                f"per table), got {len(types)}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (enums as strings, tuples as lists, ``None`` left out)."""
        return _fields_to_dict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a nested dict; missing keys take their defaults.

        Raises:
            ValueError: on an unknown key (listing the valid ones) or a bad value.
        """
        return config_from_dict(cls, values, "")

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
        """Load a TOML file, with dotted ``overrides`` merged in (``tetrarec.config.overrides``).

        The overrides are applied to the file's values before anything is validated,
        so the merged config is what must be valid: a key the file leaves out may come
        from an override alone.

        Args:
            path: the run's TOML file.
            overrides: ``"section.key=value"`` items, applied in order.

        Raises:
            ValueError: on a TOML syntax error, a malformed override, an unknown key or
                a bad value (the message names the file), or a directory for ``path``.
            FileNotFoundError: if the file does not exist.
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path} is a directory; give the run's TOML file")
        try:
            values = tomllib.loads(path.read_text())
            _apply_overrides(values, overrides)
            return cls.from_dict(values)
        except (ValueError, TypeError) as e:
            with_sets = " with the --set overrides" if overrides else ""
            raise ValueError(f"{path}{with_sets}: {e}") from e

    def with_overrides(self, overrides: Sequence[str]) -> RunConfig:
        """Apply dotted ``"section.key=value"`` overrides, in order, then validate once.

        Raises:
            ValueError: on a malformed override, an unknown key (listing the valid
                ones) or a value of the wrong type.
        """
        values = self.to_dict()
        _apply_overrides(values, overrides)
        return RunConfig.from_dict(values)


def _apply_overrides(values: dict[str, Any], overrides: Sequence[str]) -> None:
    """Set each ``"section.key=value"`` of ``overrides`` in the nested dict ``values``.

    The value's text is parsed for the key's declared type (``_parse_text``); nothing is
    validated here beyond the key's existence: the caller builds the config once.

    Raises:
        ValueError: on a malformed override or an unknown key (listing the valid ones).
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        path = key.strip().split(".")
        hint = _field_type(RunConfig, path)
        node = values
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"override {item!r}: {'.'.join(path[: i + 1])} must be a section, got {child!r}"
                )
            node = child
        node[path[-1]] = _parse_text(text.strip(), hint, key.strip())
