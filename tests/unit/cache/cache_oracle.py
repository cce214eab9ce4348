"""A plain reference of the mixed-precision cache: dictionaries and loops, no fused kernel.

Rows: ``stored[name]`` holds every row in its precision; ``cached[name]`` maps a row to
its FP32 row, FP32 state and dirty flag. The policies follow the rules written in
``tetrarec.cache.policy`` with Python sorting; updates use the optimizer rules and the
rounding stream of ``tetrarec.kernels`` (the rule and the noise are the spec, shared).
"""

from collections import Counter

import torch

from tetrarec.embedding import TableSlice, init_rows
from tetrarec.kernels.optim_rules import OPTIM_RULES, state_layout
from tetrarec.kernels.quant import decode_rows, encode_rows
from tetrarec.kernels.reference import rounding_noise
from tetrarec.types import PoolingMode, Precision


class CacheOracle:
    """The cached collection's semantics, one table at a time, in plain Python."""

    def __init__(self, tables, spec, policy, capacity, seed, static_counts=None):
        self.tables, self.spec, self.policy, self.seed = list(tables), spec, policy, seed
        self.capacity = dict(capacity)
        self.iteration = 0
        self.stored, self.state, self.cached = {}, {}, {}
        self.last, self.freq, self.clock = {}, {}, {}
        self.counts = {}
        for t in self.tables:
            self.stored[t.name] = encode_rows(init_rows(t, seed), t.precision, stochastic=False)
            self.state[t.name] = {
                k: torch.full(
                    (t.num_embeddings, w), spec.initial_accumulator if k == "sum" else 0.0
                )
                for k, w in state_layout(spec.kind, t.dim).items()
            }
            self.cached[t.name], self.last[t.name] = {}, {}
            self.freq[t.name], self.clock[t.name] = Counter(), 0
            self.counts[t.name] = [0, 0, 0, 0]  # hits, misses, evictions, write-backs
            if policy == "static":
                c = static_counts[t.name].tolist()
                top = sorted(range(t.num_embeddings), key=lambda r: (-c[r], r))
                for r in top[: self.capacity[t.name]]:
                    self._admit(t, r)

    # -- rows -----------------------------------------------------------------------------

    def _admit(self, t, r):
        w = decode_rows(self.stored[t.name][r : r + 1], t.precision, t.dim)[0]
        st = {k: v[r].clone() for k, v in self.state[t.name].items()}
        self.cached[t.name][r] = {"w": w, "state": st, "dirty": False}

    def _store(self, t, rows, w):
        """Encode FP32 rows ``w`` into the stored rows ``rows`` at this iteration."""
        rows_t = torch.tensor(rows)
        noise = None
        if t.precision is not Precision.FP32:
            key = TableSlice(table=t).row_key()
            noise = rounding_noise(self.seed, self.iteration, rows_t + key, 0, t.dim)
        self.stored[t.name][rows_t] = encode_rows(w, t.precision, stochastic=True, noise=noise)

    def _write_back(self, t, r):
        entry = self.cached[t.name][r]
        self._store(t, [r], entry["w"][None])
        for k, v in entry["state"].items():
            self.state[t.name][k][r] = v

    def _evict(self, t, r):
        self.counts[t.name][2] += 1
        if self.cached[t.name][r]["dirty"]:
            self.counts[t.name][3] += 1
            self._write_back(t, r)
        del self.cached[t.name][r]

    def flush(self):
        """Write back dirty cached rows and copy back every cached row's state."""
        for t in self.tables:
            for r, entry in self.cached[t.name].items():
                if entry["dirty"]:
                    self._write_back(t, r)
                for k, v in entry["state"].items():
                    self.state[t.name][k][r] = v

    # -- the policy -----------------------------------------------------------------------

    def _policy_step(self, t, ids):
        name, cache = t.name, self.cached[t.name]
        batch = Counter(ids)
        for r, n in batch.items():
            self.counts[name][0 if r in cache else 1] += n
        if self.policy == "lfu":
            self.freq[name].update(batch)
        misses = sorted(r for r in batch if r not in cache)
        if self.policy != "static" and self.capacity[name]:
            heat = batch if self.policy == "lru" else self.freq[name]
            misses.sort(key=lambda r: (-heat[r], r))
            free = self.capacity[name] - len(cache)
            first, rest = misses[:free], misses[free:]
            if self.policy == "lru":
                vkey = lambda r: (self.last[name][r], r)  # noqa: E731
            else:
                vkey = lambda r: (self.freq[name][r], r)  # noqa: E731
            idle = sorted((r for r in cache if r not in batch), key=vkey)
            pairs = list(zip(rest, idle))
            if self.policy == "lfu":
                pairs = [(m, v) for m, v in pairs if self.freq[name][m] > self.freq[name][v]]
            for r in first:
                self._admit(t, r)
            for m, v in pairs:
                self._evict(t, v)
                self._admit(t, m)
        if self.policy == "lru":
            for r in batch:
                if r in cache:
                    self.last[name][r] = self.clock[name]
        self.clock[name] += 1

    # -- a training step ------------------------------------------------------------------

    def step(self, bags, upstream):
        """One forward and backward; ``bags`` {feature: [[ids]]}; returns the output.

        ``upstream`` (B, sum D) is the output gradient.
        """
        for t in self.tables:
            self._policy_step(t, [r for f in t.feature_names for bag in bags[f] for r in bag])
        batch = upstream.shape[0]
        out, col = [], 0
        for t in self.tables:
            grads_ids, grads = [], []
            for f in t.feature_names:
                pooled = torch.zeros(batch, t.dim)
                for b, bag in enumerate(bags[f]):
                    for r in bag:
                        pooled[b] += self._row(t, r)
                    g = upstream[b, col : col + t.dim]
                    if t.pooling is PoolingMode.MEAN and bag:
                        pooled[b] /= len(bag)
                        g = g / len(bag)
                    grads_ids += bag
                    grads += [g] * len(bag)
                out.append(pooled)
                col += t.dim
            if grads_ids:
                self._update(t, torch.tensor(grads_ids), torch.stack(grads))
        self.iteration += 1
        return torch.cat(out, dim=1)

    def _row(self, t, r):
        entry = self.cached[t.name].get(r)
        if entry is not None:
            return entry["w"]
        return decode_rows(self.stored[t.name][r : r + 1], t.precision, t.dim)[0]

    def _update(self, t, ids, grads):
        # duplicates summed in position order, as the fused backward does
        sorted_ids, perm = torch.sort(ids, stable=True)
        uniq, inverse = torch.unique_consecutive(sorted_ids, return_inverse=True)
        summed = torch.zeros(uniq.numel(), t.dim).index_add_(0, inverse, grads[perm])
        cache = self.cached[t.name]
        hot = [k for k, r in enumerate(uniq.tolist()) if r in cache]
        cold = [k for k, r in enumerate(uniq.tolist()) if r not in cache]
        if hot:
            rows = [uniq[k].item() for k in hot]
            w = torch.stack([cache[r]["w"] for r in rows])
            st = {
                k: torch.stack([cache[r]["state"][k] for r in rows])
                for k in cache[rows[0]]["state"]
            }
            OPTIM_RULES[self.spec.kind](w, summed[hot], st, self.spec, self.spec.lr)
            for j, r in enumerate(rows):
                cache[r] = {"w": w[j], "state": {k: v[j] for k, v in st.items()}, "dirty": True}
        if cold:
            rows = uniq[cold]
            w = decode_rows(self.stored[t.name][rows], t.precision, t.dim)
            st = {k: v[rows] for k, v in self.state[t.name].items()}
            OPTIM_RULES[self.spec.kind](w, summed[cold], st, self.spec, self.spec.lr)
            self._store(t, rows.tolist(), w)
            for k, v in st.items():
                self.state[t.name][k][rows] = v
