"""Synthetic click data: power-law ids, multi-hot bags and a planted teacher.

Every value is a pure function of ``(seed, row index)`` through a counter-based
generator (splitmix64 of a per-stream key plus a counter), so any row can be read in
any order, on any rank, with no state and no memory beyond the (small) teacher tables.

Row ``i`` of the generator::

    dense[i, d]   ~ N(0, 1)                                  d < num_dense
    len_f(i)      = 1 + floor(U * (2*pool_f - 1))            mean pool_f; 1 when one-hot
    id            = (a_f * rank + b_f) mod n_f,  rank ~ Zipf(s) on [0, n_f)
    logit(i)      = dense_weight * <dense_i, w> / |w|
                  + id_weight * sum_f mean_bag t_f(id) / sqrt(F)
                  + interaction_weight * sum_{f<g} <v_f, v_g> / sqrt(F (F-1) / 2)
                  + bias                                      (v_f = mean_bag u_f(id))
    label(i)      = 1 if U < sigmoid(logit(i)) else 0

with a per-id teacher scalar ``t_f(id) ~ N(0, 1)`` and vector ``u_f(id) ~ N(0, I_k / k)``,
and ``bias`` solved so that the mean label is about ``target_ctr``. Ids are Zipf
distributed, so the frequent ids' teacher values are learnable and the rare ones act as
noise: a model cannot reach the Bayes AUC, but a DLRM gets well above 0.5.
The affine map ``rank -> id`` (``a_f`` coprime with ``n_f``) scatters the hot ids over
the table, as real hashed ids are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from tetrarec.data.config import SyntheticConfig
from tetrarec.embedding.config import TableConfig, feature_order
from tetrarec.sparse import Batch, SparseFeatures

__all__ = ["SyntheticDataset", "zipf_ranks"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1
_SLOT_BITS = 16  # counter = row << 16 | slot, so bags of up to 65536 ids
_TEACHER_CACHE_ROWS = 1 << 22  # teacher values of up to this many rows in all are cached

# Stream numbers: each kind of random value has its own key.
_DENSE, _LENGTH, _ID, _LABEL, _W, _T, _U, _PERM = range(8)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer of ``x + golden`` (uint64 array, wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    x = x ^ (x >> np.uint64(31))
    return x


def _key(seed: int, stream: int, feature: int = 0) -> np.uint64:
    """The key of one stream (a scalar), mixed from its coordinates."""
    k = np.array([seed & _MASK], dtype=np.uint64)
    for part in (stream, feature):
        k = _splitmix(k ^ np.uint64(part & _MASK))
    return np.uint64(k[0])


def _uniform(key: np.uint64, counter: np.ndarray) -> np.ndarray:
    """Uniform ``[0, 1)`` float64, one per ``counter`` (uint64 array)."""
    u: np.ndarray = (_splitmix(counter + key) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return u


def _normal(key: np.uint64, counter: np.ndarray) -> np.ndarray:
    """Standard normal float64, one per ``counter`` (Box-Muller on two uniforms)."""
    c = counter.astype(np.uint64) << np.uint64(1)
    u1 = _uniform(key, c)
    u2 = _uniform(key, c | np.uint64(1))
    z: np.ndarray = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
    return z


def zipf_ranks(u: np.ndarray, n: int, s: float) -> np.ndarray:
    """Map uniforms to ranks in ``[0, n)`` with ``P(rank k) ~ (k+1)^-s`` (approximately).

    The inverse CDF of the continuous power law on ``[1, n+1)``, floored; exact enough
    for synthetic data and O(1) per draw for any ``n``.

    >>> zipf_ranks(np.array([0.0, 0.5, 0.999999]), 1000, 1.0).tolist()
    [0, 30, 999]
    """
    if abs(s - 1.0) < 1e-9:
        x = np.exp(u * math.log(n + 1.0))
    else:
        a = 1.0 - s
        x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, n - 1)


class SyntheticDataset:
    """Rows ``[row_offset, row_offset + num_samples)`` of the synthetic stream.

    The training split is rows ``[0, num_samples)`` and the evaluation split the
    ``eval_samples`` rows after it: same teacher, disjoint samples.

    Args:
        config: generator and teacher settings.
        tables: the model's tables; feature ``i`` is ``feature_order(tables)[i]`` and
            draws ids in ``[0, num_embeddings)`` of its table.
        num_samples: rows in this split.
        row_offset: global number of this split's first row.
    """

    def __init__(
        self,
        config: SyntheticConfig,
        tables: Sequence[TableConfig],
        *,
        num_samples: int,
        row_offset: int = 0,
    ) -> None:
        self.config = config
        self.keys = feature_order(list(tables))
        rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
        self.table_rows = tuple(rows[k] for k in self.keys)
        self.num_samples = num_samples
        self.num_dense = config.num_dense
        self.row_offset = row_offset
        self.bad_lines = None
        pools = config.pooling_per_feature or (config.pooling,) * len(self.keys)
        if len(pools) != len(self.keys):
            raise ValueError(
                f"pooling_per_feature has {len(pools)} entries for {len(self.keys)} features"
            )
        self.pooling = tuple(pools)
        seed = config.seed
        self._perm = [self._affine(f, n) for f, n in enumerate(self.table_rows)]
        w = _normal(_key(seed, _W), np.arange(max(1, self.num_dense), dtype=np.uint64))
        self._w = (w[: self.num_dense] / max(np.linalg.norm(w[: self.num_dense]), 1e-12)).astype(
            np.float32
        )
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        budget = _TEACHER_CACHE_ROWS  # about 80 MB; larger tables hash ids on the fly
        for f, n in enumerate(self.table_rows):
            if n <= budget:
                self._cache[f] = self._teacher_values(f, np.arange(n, dtype=np.int64))
                budget -= n
        self._bias = 0.0
        self._bias = self._solve_bias()

    def _affine(self, f: int, n: int) -> tuple[int, int]:
        """``(a, b)`` of the rank -> id permutation of feature ``f``; ``gcd(a, n) == 1``."""
        r = _splitmix(np.array([_key(self.config.seed, _PERM, f)], dtype=np.uint64))[0]
        a = int(r % np.uint64(n)) | 1
        while math.gcd(a, n) != 1:
            a += 1
        return a % n or 1, int((r >> np.uint64(32)) % np.uint64(n))

    def _teacher_values(self, f: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(t (n,), u (n, k))`` teacher scalar and vector of feature ``f``'s ``ids``."""
        k = self.config.interaction_rank
        seed = self.config.seed
        uid = ids.astype(np.uint64)
        t = _normal(_key(seed, _T, f), uid).astype(np.float32)
        cnt = (uid[:, None] * np.uint64(k)) + np.arange(k, dtype=np.uint64)[None, :]  # (n, k)
        u = (_normal(_key(seed, _U, f), cnt) / math.sqrt(k)).astype(np.float32)
        return t, u

    def _features(self, rows: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per feature ``(ids (N_f,), lengths (B,))`` of the global ``rows``."""
        seed = self.config.seed
        out = []
        shifted = rows.astype(np.uint64) << np.uint64(_SLOT_BITS)  # (B,)
        for f, n in enumerate(self.table_rows):
            p = self.pooling[f]
            lengths = np.ones(rows.shape[0], dtype=np.int64)
            if p > 1:
                u = _uniform(_key(seed, _LENGTH, f), shifted)
                lengths += np.floor(u * (2 * p - 1)).astype(np.int64)
            total = int(lengths.sum())
            starts = np.cumsum(lengths) - lengths  # (B,)
            slot = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)  # (N_f,)
            counter = np.repeat(shifted, lengths) | slot.astype(np.uint64)
            ranks = zipf_ranks(_uniform(_key(seed, _ID, f), counter), n, self.config.zipf)
            a, b = self._perm[f]
            ids = (ranks * a + b) % n  # a < n <= 2**31 keeps this in int64
            out.append((ids, lengths))
        return out

    def _logits(self, dense: np.ndarray, feats: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """``(B,)`` teacher logits without the bias."""
        cfg = self.config
        b = dense.shape[0]
        k = cfg.interaction_rank
        id_term = np.zeros(b)
        z = np.zeros((b, k))
        sq = np.zeros(b)
        for f, (ids, lengths) in enumerate(feats):
            if f in self._cache:
                t_all, u_all = self._cache[f]
                t, u = t_all[ids], u_all[ids]
            else:
                t, u = self._teacher_values(f, ids)
            if self.pooling[f] == 1:  # one-hot: the bag mean is the id's own value
                id_term += t
                v = u.astype(np.float64)
            else:
                owner = np.repeat(np.arange(b), lengths)  # (N_f,) sample of each id
                scale = 1.0 / np.maximum(lengths, 1)  # bag mean
                id_term += np.bincount(owner, weights=t, minlength=b) * scale
                sums = [np.bincount(owner, u[:, j], minlength=b) for j in range(k)]
                v = np.stack(sums, 1) * scale[:, None]  # (B, k)
            z += v
            sq += (v * v).sum(1)
        nf = len(feats)
        pairs = max(nf * (nf - 1) / 2, 1.0)
        inter = 0.5 * ((z * z).sum(1) - sq) / math.sqrt(pairs)
        dense_term = dense.astype(np.float64) @ self._w if self.num_dense else 0.0
        logits: np.ndarray = (
            cfg.dense_weight * dense_term
            + cfg.id_weight * id_term / math.sqrt(max(nf, 1))
            + cfg.interaction_weight * inter
        )
        return logits

    def _solve_bias(self) -> float:
        """The intercept that makes the mean click probability ``target_ctr`` (bisection)."""
        rows = np.arange(4096, dtype=np.int64)
        _, logits = self._generate(rows)
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < self.config.target_ctr:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def _generate(
        self, rows: np.ndarray
    ) -> tuple[tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]], np.ndarray]:
        """``((dense (B, D), features), logits (B,))`` of the global ``rows``."""
        d = self.num_dense
        counter = (rows.astype(np.uint64)[:, None] << np.uint64(_SLOT_BITS)) + np.arange(
            d, dtype=np.uint64
        )  # (B, D)
        dense = _normal(_key(self.config.seed, _DENSE), counter).astype(np.float32)
        feats = self._features(rows)
        return (dense, feats), self._logits(dense, feats) + self._bias

    def click_probability(self, indices: np.ndarray) -> np.ndarray:
        """The teacher's ``P(label = 1)`` of rows ``indices`` of this split (for tests)."""
        rows = np.asarray(indices, dtype=np.int64) + self.row_offset
        _, logits = self._generate(rows)
        p: np.ndarray = 1.0 / (1.0 + np.exp(-logits))
        return p

    def read(self, indices: np.ndarray) -> Batch:
        """The batch of rows ``indices`` (in that order) of this split.

        Raises:
            ValueError: if an index is outside ``[0, num_samples)``.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise ValueError(
                f"row indices must be in [0, {self.num_samples}), got [{idx.min()}, {idx.max()}]"
            )
        rows = idx + self.row_offset
        (dense, feats), logits = self._generate(rows)
        prob = 1.0 / (1.0 + np.exp(-logits))
        labels = (_uniform(_key(self.config.seed, _LABEL), rows.astype(np.uint64)) < prob).astype(
            np.float32
        )
        values = np.concatenate([ids for ids, _ in feats]) if feats else np.zeros(0, np.int64)
        lengths = np.concatenate([ln for _, ln in feats]) if feats else np.zeros(0, np.int64)
        sparse = SparseFeatures(
            self.keys,
            torch.from_numpy(values),
            torch.from_numpy(lengths),
            int(idx.shape[0]),
            None,
            tuple(ids.shape[0] for ids, _ in feats),
        )
        return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels))
