"""Opt-in, data-dependent checks of sparse inputs. These sync with the device."""

from __future__ import annotations

from collections.abc import Mapping

from tetrarec.sparse.features import SparseFeatures

__all__ = ["validate_features"]


def validate_features(sf: SparseFeatures, num_rows: Mapping[str, int] | None = None) -> None:
    """Check lengths, value counts and (optionally) id ranges.

    Args:
        sf: the features to check.
        num_rows: optional ``{key: rows of the table the key looks up}``.

    Raises:
        ValueError: naming the feature and the offending id or length.
    """
    if bool((sf.lengths < 0).any()):
        raise ValueError("negative bag length")
    total = int(sf.lengths.sum())
    if total != sf.values.numel():
        raise ValueError(f"lengths sum to {total} but there are {sf.values.numel()} values")
    if num_rows is None:
        return
    for key, (vals, _) in sf.to_dict().items():
        if key not in num_rows or vals.numel() == 0:
            continue
        lo, hi = int(vals.min()), int(vals.max())
        if lo < 0 or hi >= num_rows[key]:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"feature {key!r}: id {bad} is outside its table of {num_rows[key]} rows"
            )
