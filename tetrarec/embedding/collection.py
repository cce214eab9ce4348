"""The unsharded ``EmbeddingBagCollection``: the oracle every other path is tested against.

For F features over B samples with bags of ``L[f][b]`` ids, the collection returns
``(B, sum of the features' dims)``::

    SparseFeatures (F, B, L[f][b])  ->  PooledEmbeddings (B, D_0 + D_1 + ... )

Written for readability, not speed: one ``torch.nn.EmbeddingBag`` per table with sparse
gradients, updated by a separate sparse optimizer (``tetrarec.train.optim``). The fused
table-batched collection in ``tetrarec.kernels`` replaces it without changing any model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tetrarec.embedding.config import TableConfig, feature_order
from tetrarec.embedding.init import draw_seed, init_rows
from tetrarec.embedding.report import UncachedWholeTables
from tetrarec.sparse import PooledEmbeddings, SparseFeatures, permute_keys

__all__ = ["EmbeddingBagCollection", "check_ids"]


def check_ids(feature: str, ids: torch.Tensor, num_rows: int) -> None:
    """Raise a readable error if an id of ``feature`` falls outside ``[0, num_rows)``.

    Syncs once (a min and a max); cheap next to a lookup.

    Raises:
        ValueError: naming the feature, the id and the table size.
    """
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo_i, hi_i = int(lo), int(hi)
    if lo_i < 0 or hi_i >= num_rows:
        bad = lo_i if lo_i < 0 else hi_i
        raise ValueError(
            f"feature {feature!r}: id {bad} is outside its table of {num_rows} rows "
            f"(valid ids are 0..{num_rows - 1})"
        )


class EmbeddingBagCollection(UncachedWholeTables, nn.Module):
    """One ``nn.EmbeddingBag`` per table; pooled lookups of every feature.

    Args:
        tables: the tables; each feature looks up exactly one table.
        check_bounds: raise ``ValueError`` for out-of-range ids (default on).
        seed: seeds the initial rows (``init_rows``: the same rows as every other
            collection and sharded layout with this seed); ``None`` draws one from the
            global torch RNG.

    Example:
        >>> ebc = EmbeddingBagCollection([TableConfig(name="t", num_embeddings=10, dim=4)])
        >>> sf = SparseFeatures.from_lists({"t": [[1, 2], [3]]})
        >>> ebc(sf).values.shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        check_bounds: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.tables = tuple(tables)
        self.feature_names = feature_order(self.tables)
        self.feature_dims = tuple(t.dim for t in self.tables for _ in t.feature_names)
        self.check_bounds = check_bounds
        self.seed = draw_seed() if seed is None else seed
        self.embedding_bags = nn.ModuleDict()
        for t in self.tables:
            bag = nn.EmbeddingBag(t.num_embeddings, t.dim, mode=t.pooling.value, sparse=True)
            with torch.no_grad():
                bag.weight.copy_(init_rows(t, self.seed))
            self.embedding_bags[t.name] = bag

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """Pool every feature; output columns follow ``self.feature_names``."""
        if features.keys != self.feature_names:
            features = permute_keys(features, self.feature_names)
        per_key = features.to_dict()
        weights = None
        if features.weights is not None:
            counts = features.value_counts_host()
            weights = dict(zip(features.keys, torch.split(features.weights, list(counts))))
        outs = []
        for t in self.tables:
            bag = self.embedding_bags[t.name]
            for f in t.feature_names:
                ids, lengths = per_key[f]
                if self.check_bounds:
                    check_ids(f, ids, t.num_embeddings)
                offsets = torch.zeros(lengths.numel(), dtype=torch.int64, device=ids.device)
                torch.cumsum(lengths[:-1], 0, out=offsets[1:])
                psw = weights[f] if weights is not None else None
                outs.append(bag(ids.long(), offsets, per_sample_weights=psw))
        return PooledEmbeddings(self.feature_names, self.feature_dims, torch.cat(outs, dim=1))

    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{table name: (rows, dim) weight}``, the layout checkpoints use.

        The parameters themselves (their ``.grad`` is the tables' sparse gradient); the
        fused and cached collections, whose rows are not parameters, return copies.
        """
        return {t.name: self._weight(t.name) for t in self.tables}

    # -- what the trainer reads (HeldTables): layout and cache answers from the mixin ----

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The parameters that receive sparse gradients (one per table)."""
        return [self._weight(t.name) for t in self.tables]

    def _weight(self, table: str) -> nn.Parameter:
        # Table names hold no ".": nn.ModuleDict refuses such keys.
        return self.embedding_bags.get_parameter(f"{table}.weight")
