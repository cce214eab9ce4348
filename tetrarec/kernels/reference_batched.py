"""The portable table-batched lookup and fused backward + update: all tables at once.

What a GPU (any device but the CPU) runs, and the CPU with ``TETRAREC_KERNELS=batched``:
a few batched tensor operations over every id of a row store, with no Python loop over
tables or ids and one host read per call (``HOST_SYNCS_PER_CALL``). The results are bit
for bit those of the per-table loop in ``reference.py`` (the definition, and what the
CPU runs without the compiled kernels: its per-table working set stays in cache, which
makes it 2-2.5x faster there): every sum adds the same terms in the same order, so on
one device (a GPU in deterministic mode too) the two give the same bits.

Legend: N ids, F features, B batch, T tables of the store, U touched rows, D a table's
dim, Dmax the store's widest, W a row's storage width.

Forward::

    bag_N, feat_N, table_N     bag, feature and table of each id (key-major values)
    rows_ND   decoded rows, padded with zeros to Dmax (columns never mix)
    pooled    zeros(F*B, Dmax).index_add_(0, bag_N, rows_ND * psw)   (position order)
    out[b, cols_f + c] = pooled[f*B + b, c] / L (mean)    for c < D of f's table

Backward + update::

    key_N     row of each id in one numbering of the store's rows, tables ranked by
              (dim, index): a dim's rows are contiguous
    stable sort of key_N -> segments of equal keys (a row's ids in position order)
    per distinct dim d (a loop over row shapes, not tables):
        per-id grads (n, d) -> index_add_ in sorted order -> (U, d)
        decode rows -> OPTIM_RULES[kind] -> encode rows; write rows and state

Host syncs (``HOST_SYNCS_PER_CALL = 1``): the one ``tolist()`` in ``_host_read``, of the
meta tensors, the batch checks (negative lengths, ids against lengths, the first id
outside its table) and, in backward, the touched rows and ids per table (the shapes of
the update). Nothing else reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.kernels.optim_rules import OPTIM_RULES, state_layout
from tetrarec.kernels.quant import decode_rows, encode_rows
from tetrarec.kernels.reference import rounding_noise
from tetrarec.sparse import offsets_from_lengths
from tetrarec.types import OptimizerKind, Precision

__all__ = ["HOST_SYNCS_PER_CALL", "backward_update", "pooled_forward"]

#: Host synchronisations ``pooled_forward`` and ``backward_update`` each make per call
#: (one row store): the ``tolist()`` of ``_host_read``. Counted during a training step
#: by ``tests/unit/kernels/test_portable_host_syncs.py``.
HOST_SYNCS_PER_CALL = 1

_BIG = 2**62  # larger than any row key or id


@dataclass(frozen=True)
class _Ids:
    """Where each id of a key-major batch belongs (all ``(N,)`` int64 on the device)."""

    ids: torch.Tensor  # the id
    bag: torch.Tensor  # its bag, f * B + b
    feat: torch.Tensor  # its feature
    table: torch.Tensor  # its table in this store, -1 for another store's feature
    offsets: torch.Tensor  # (F*B + 1,) bag offsets
    bag_feat: torch.Tensor  # (F*B,) the feature of each bag


def _locate_ids(values: torch.Tensor, offsets: torch.Tensor, meta: list[torch.Tensor]) -> _Ids:
    """Bag, feature and table of every id, without reading the device.

    Bags beyond the lengths' total (a batch that fails the checks) are clamped, so that
    nothing here fails before the checks are read.
    """
    n, bags = values.numel(), offsets.numel() - 1
    feat_table = meta[4]
    batch = max(bags // max(feat_table.numel(), 1), 1)
    marks = torch.zeros(n + 1, dtype=torch.int64, device=values.device)
    if bags > 1:  # bag k starts at offsets[k]: count the starts at or before each id
        marks.scatter_add_(0, offsets[1:-1].clamp(0, n), torch.ones_like(offsets[1:-1]))
    bag = marks[:n].cumsum(0).clamp_(0, max(bags - 1, 0))
    feat = (bag // batch).clamp_(0, max(feat_table.numel() - 1, 0))
    table = feat_table[feat] if feat_table.numel() else torch.full_like(feat, -1)
    bag_feat = torch.arange(bags, device=values.device) // batch
    bag_feat = bag_feat.clamp_(max=max(feat_table.numel() - 1, 0))
    return _Ids(
        ids=values.long(), bag=bag, feat=feat, table=table, offsets=offsets, bag_feat=bag_feat
    )


def _checks(loc: _Ids, rows_t: torch.Tensor, n: int) -> torch.Tensor:
    """``(8,)`` int64 batch facts read on the host with the meta (``_host_read``).

    ``[ids the lengths add up to, any negative length, its index, its length,
    any id outside its table, the feature of the first (by position), that id, the id
    the forward reports for that feature]``. Indices stay 1-element tensors: indexing
    with a 0-d tensor would read it on the host.
    """
    off = loc.offsets
    lengths = torch.cat([off[1:] - off[:-1], off.new_zeros(1)])  # never empty
    neg = lengths < 0
    i = neg.long().argmax().view(1)
    facts = [off[-1:], neg.any().long().view(1), i, lengths[i]]
    if n == 0:
        return torch.cat([*facts, off.new_zeros(4)])
    rows = rows_t[loc.table.clamp(min=0)]  # (N,)
    bad = (loc.table >= 0) & ((loc.ids < 0) | (loc.ids >= rows))
    pos = bad.long().argmax().view(1)  # the first bad id by position: key-major, so its
    f = loc.feat[pos]  # feature is the first (in feature order) with a bad id
    in_f = loc.feat == f
    lo = torch.where(in_f, loc.ids, _BIG).amin()
    hi_bad = torch.where(in_f & (loc.ids >= rows), loc.ids, _BIG).amin()
    reported = torch.where(lo < 0, lo, hi_bad).view(1)  # as the compiled kernel reports it
    return torch.cat([*facts, bad.any().long().view(1), f, loc.ids[pos], reported])


@dataclass(frozen=True)
class _Host:
    """The meta tensors and the batch facts, read in one host sync."""

    w_off: list[int]
    dims: list[int]
    rows: list[int]
    feat_table: list[int]
    feat_cols: list[int]
    facts: list[int]
    extra: list[int]


def _host_read(meta: list[torch.Tensor], facts: torch.Tensor, extra: torch.Tensor) -> _Host:
    """The call's one host sync: meta, batch facts and ``extra`` in one ``tolist()``.

    Syncs: once.
    """
    parts = [*meta[:9], facts, extra]
    flat: list[int] = torch.cat([p.reshape(-1).long() for p in parts]).tolist()
    out, at = [], 0
    for p in parts:
        out.append(flat[at : at + p.numel()])
        at += p.numel()
    return _Host(out[0], out[1], out[2], out[4], out[5], out[9], out[10])


def _raise_bad_batch(
    host: _Host, where: str, what: str, width: int, values: torch.Tensor, psw: torch.Tensor | None
) -> None:
    """Raise as the compiled kernel's ``check_batch`` does for a batch off the layout.

    Raises:
        RuntimeError: for a negative length, fewer columns than the store's features
            need, or fewer ids (or per-id weights) than the lengths add up to.
    """
    total, any_neg, i, length = host.facts[:4]
    if any_neg:
        raise RuntimeError(f"tetrarec tbe: bag length {i} is {length} (lengths must be >= 0)")
    cols = max(
        (host.feat_cols[f] + host.dims[t] for f, t in enumerate(host.feat_table) if t >= 0),
        default=0,
    )
    if width < cols:
        raise RuntimeError(
            f"tetrarec tbe {where}: {what} has {width} columns, the features need {cols}"
        )
    if total != values.numel():
        raise RuntimeError(
            f"tetrarec tbe {where}: the lengths add up to {total} ids, values holds "
            f"{values.numel()}"
        )
    if psw is not None and total != psw.numel():
        raise RuntimeError(
            f"tetrarec tbe {where}: the lengths add up to {total} ids, the per-id weights "
            f"hold {psw.numel()}"
        )


def _check_lengths_count(where: str, lengths: torch.Tensor, features: int, batch: int) -> None:
    """Raise for lengths of another count than ``F * batch`` (shapes only: no sync)."""
    if lengths.numel() != features * batch:
        raise RuntimeError(
            f"tetrarec tbe {where}: lengths must have F*B = {features}*{batch} entries, "
            f"got {lengths.numel()}"
        )


def _row_geometry(prec: Precision, dims_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T,)`` storage width of a row and payload bytes (integer rows) of each table."""
    if not prec.is_integer:
        return dims_t, dims_t
    payload = (dims_t * prec.bits + 7) // 8
    align = prec.row_alignment
    return (payload + 4 + align - 1) // align * align, payload


def _width(prec: Precision, dim: int) -> int:
    """Storage elements of one row (host ints)."""
    return prec.row_bytes(dim) if prec.is_integer else dim


def _row_matrix(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` as ``(numel // width, width)`` rows (a view)."""
    return flat.as_strided((flat.numel() // width, width), (width, 1), flat.storage_offset())


def _gather_rows(
    flat: torch.Tensor, start: torch.Tensor, width: int, aligned: bool
) -> torch.Tensor:
    """``(n, width)`` elements of ``flat`` from each ``start`` ``(n,)``.

    ``aligned`` (every start a multiple of ``width``): one row gather, not ``n * width``
    element indices.
    """
    if aligned:
        return _row_matrix(flat, width).index_select(0, start // width)
    return flat[start[:, None] + torch.arange(width, device=start.device)]


def _scatter_rows(
    flat: torch.Tensor, start: torch.Tensor, width: int, aligned: bool, rows: torch.Tensor
) -> None:
    """Write ``rows`` ``(n, width)`` back where ``_gather_rows`` read them (distinct)."""
    if aligned:
        _row_matrix(flat, width).index_copy_(0, start // width, rows)
    else:
        flat[start[:, None] + torch.arange(width, device=start.device)] = rows


def _decoded_rows(
    weights: torch.Tensor,
    prec: Precision,
    start: torch.Tensor,
    dim: torch.Tensor,
    payload: torch.Tensor,
    dmax: int,
    uniform: bool,
    aligned: bool = False,
) -> torch.Tensor:
    """FP32 ``(n, dmax)`` rows starting at flat element ``start`` ``(n,)`` of ``weights``.

    Row ``i`` has ``dim[i]`` columns; the rest are zero (unless ``uniform``: every row
    has ``dmax``; ``aligned``: and every start is a multiple of the row width). The
    arithmetic is ``quant.decode_rows``'s, element by element.
    """
    if uniform:
        width = prec.row_bytes(dmax) if prec.is_integer else dmax
        return decode_rows(_gather_rows(weights, start, width, aligned), prec, dmax)
    c = torch.arange(dmax, device=start.device)[None, :]  # (1, dmax)
    col = c if uniform else torch.minimum(c, (dim - 1).clamp(min=0)[:, None])
    if prec.is_integer:
        byte = col if prec.bits == 8 else col // 2
        q = weights[start[:, None] + byte]  # (n, dmax) uint8
        if prec.bits == 4:
            q = (q >> ((col % 2) * 4).to(torch.uint8)) & 0x0F
        tail_at = start[:, None] + payload[:, None] + torch.arange(4, device=start.device)
        tail = weights[tail_at].contiguous().view(torch.float16).float()  # (n, 2)
        rows = q.float() * tail[:, 0:1] + tail[:, 1:2]
    else:
        rows = weights[start[:, None] + col].float()
    if not uniform:
        rows = torch.where(c < dim[:, None], rows, 0.0)
    return rows


def pooled_forward(
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    out: torch.Tensor,
    precision: str,
    check_bounds: bool,
) -> torch.Tensor:
    """Pool the features of one row store into their columns of ``out`` (B, sum dims).

    Syncs: once (``_host_read``).

    Returns:
        ``(2,)`` int64 host tensor ``[feature, id]`` of the first feature (in feature
        order) with an id outside its table and its smallest such id (its most
        negative id if it has one), ``[-1, -1]`` if none; checked when ``check_bounds``.
        Nothing is written then.

    Raises:
        RuntimeError: for a batch off the layout (see ``_raise_bad_batch``).
    """
    prec = Precision(precision)
    batch, width = out.shape
    _check_lengths_count("forward", lengths, meta[4].numel(), batch)
    offsets = offsets_from_lengths(lengths.long())
    loc = _locate_ids(values, offsets, meta)
    n = values.numel()
    empty = torch.empty(0, dtype=torch.int64, device=values.device)
    host = _host_read(meta, _checks(loc, meta[2], n), empty)
    _raise_bad_batch(host, "forward", "out", width, values, per_sample_weights)
    if check_bounds and host.facts[4]:
        return torch.tensor([host.facts[5], host.facts[7]], dtype=torch.int64)
    if all(t < 0 for t in host.feat_table) or batch == 0:
        return torch.tensor([-1, -1], dtype=torch.int64)
    dims_t = meta[1]
    row_w, payload_t = _row_geometry(prec, dims_t)
    dmax = max(host.dims)
    uniform = min(host.dims) == dmax
    t = loc.table.clamp(min=0)
    ids = torch.where(loc.table >= 0, loc.ids, 0)
    start = meta[0][t] + ids * row_w[t]
    aligned = uniform and all(o % _width(prec, dmax) == 0 for o in host.w_off)
    emb = _decoded_rows(weights, prec, start, dims_t[t], payload_t[t], dmax, uniform, aligned)
    if per_sample_weights is not None:
        emb = emb * per_sample_weights[:, None]
    pooled = torch.zeros(lengths.numel(), dmax, device=out.device).index_add_(0, loc.bag, emb)
    mean = meta[6].bool()[:, None].expand(-1, batch).reshape(-1)  # (F*B,)
    pooled = torch.where(
        mean[:, None], pooled / lengths.clamp(min=1).unsqueeze(1), pooled
    )  # (F*B, Dmax)
    _write_columns(out, pooled, host, batch, dmax)
    return torch.tensor([-1, -1], dtype=torch.int64)


def _write_columns(
    out: torch.Tensor, pooled: torch.Tensor, host: _Host, batch: int, dmax: int
) -> None:
    """``out[b, cols_f + c] = pooled[f*B + b, c]`` for this store's features, ``c < D``."""
    feats: list[int] = []  # one entry per output column of this store (host lists)
    cs: list[int] = []
    cols: list[int] = []
    for f, t in enumerate(host.feat_table):
        if t >= 0:
            d = host.dims[t]
            feats += [f] * d
            cs += range(d)
            cols += range(host.feat_cols[f], host.feat_cols[f] + d)
    dev = out.device
    src = pooled.view(-1, batch, dmax)  # (F, B, Dmax)
    # host lists to the device: copies, not reads
    at = [torch.tensor(x, dtype=torch.int64, device=dev) for x in (feats, cs, cols)]
    out.index_copy_(1, at[2], src[at[0], :, at[1]].T)  # (B, J)


def backward_update(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    states: list[torch.Tensor],
    state_offsets: list[torch.Tensor],
    optimizer: str,
    hparams: list[float],
    precision: str,
    flags: list[int],
) -> torch.Tensor:
    """Apply the fused optimizer to every row the batch touched; see ``ops.py``.

    Syncs: once (``_host_read``).

    Returns:
        ``(N,)`` gradient w.r.t. ``per_sample_weights`` (empty if none or not asked).

    Raises:
        RuntimeError: for a batch off the layout, or an id outside its table (naming
            the feature's index and the first such id by position), before any update.
    """
    prec, kind = Precision(precision), OptimizerKind(optimizer)
    batch, width = grad_out.shape
    _check_lengths_count("backward", lengths, meta[4].numel(), batch)
    offsets = offsets_from_lengths(lengths.long())
    loc = _locate_ids(values, offsets, meta)
    n = values.numel()
    order = _SortedRows.of(loc, meta)
    extra = torch.cat([order.counts, *(o.long() for o in state_offsets)])
    host = _host_read(meta, _checks(loc, meta[2], n), extra)
    _raise_bad_batch(host, "backward", "grad_out", width, values, per_sample_weights)
    if host.facts[4]:
        f = host.facts[5]
        raise RuntimeError(
            f"tetrarec tbe backward: feature {f} (its index in the feature order): "
            f"id {host.facts[6]} is outside its table of {host.rows[host.feat_table[f]]} rows"
        )
    stochastic, seed, iteration, _deterministic, want_psw_grad = flags
    lr, eps, beta1, beta2, weight_decay = hparams
    spec = SparseOptimizerSpec(
        kind=kind, lr=lr, eps=eps, beta1=beta1, beta2=beta2, weight_decay=weight_decay
    )
    psw_grad = None
    if per_sample_weights is not None and want_psw_grad:
        psw_grad = torch.zeros_like(per_sample_weights)
    step = _Step(grad_out, weights, meta, loc, per_sample_weights, psw_grad, prec, batch)
    tables = len(host.dims)
    uniq_t, ids_t = host.extra[:tables], host.extra[tables : 2 * tables]
    st_off = [host.extra[(2 + k) * tables : (3 + k) * tables] for k in range(len(states))]
    a = u = 0
    for d in sorted(set(host.dims)):  # a loop over row shapes (distinct dims), not tables
        in_d = [t for t in range(tables) if host.dims[t] == d]
        n_d, u_d = sum(ids_t[t] for t in in_d), sum(uniq_t[t] for t in in_d)
        widths = [_width(prec, d), *state_layout(kind, d).values()]
        offs = [host.w_off, *st_off]
        aligned = [all(o[t] % wd == 0 for t in in_d) for o, wd in zip(offs, widths)]
        if n_d:
            rows = step.summed(order, a, a + n_d, u, u_d, d, aligned[0])
            _update_rows(step, rows, states, state_offsets, kind, spec, flags[:3], d, aligned)
        a, u = a + n_d, u + u_d
    del stochastic, seed, iteration
    if psw_grad is None:
        return torch.empty(0, device=grad_out.device)
    return psw_grad


@dataclass(frozen=True)
class _SortedRows:
    """The store's ids stably sorted by row (tables ranked by (dim, index))."""

    perm: torch.Tensor  # (N,) position of each sorted id
    seg: torch.Tensor  # (N,) index of its row among the touched rows (sorted order)
    counts: torch.Tensor  # (2T,) touched rows per table, then ids per table

    @staticmethod
    def of(loc: _Ids, meta: list[torch.Tensor]) -> _SortedRows:
        """Sort without reading the device; another store's ids sort last."""
        dims_t, rows_t = meta[1], meta[2]
        tables, dev = dims_t.numel(), loc.ids.device
        by_dim = torch.argsort(dims_t * max(tables, 1) + torch.arange(tables, device=dev))
        rank = torch.empty_like(by_dim)
        rank[by_dim] = torch.arange(tables, device=dev)
        first = torch.zeros(tables, dtype=torch.int64, device=dev)  # first key of a table
        if tables:
            first[by_dim] = torch.cumsum(rows_t[by_dim], 0) - rows_t[by_dim]
        t = loc.table.clamp(min=0)
        valid = loc.table >= 0
        if tables:
            valid = valid & (loc.ids >= 0) & (loc.ids < rows_t[t])
            key = torch.where(valid, first[t] + loc.ids, _BIG)
        else:
            key = torch.full_like(loc.ids, _BIG)
        skey, perm = torch.sort(key, stable=True)
        head = torch.ones_like(skey, dtype=torch.bool)
        head[1:] = skey[1:] != skey[:-1]
        seg = torch.cumsum(head.long(), 0) - 1
        ok = valid[perm]
        counts = torch.zeros(2 * tables, dtype=torch.int64, device=dev)
        if tables:
            ts = t[perm]
            counts.scatter_add_(0, ts, (head & ok).long())
            counts.scatter_add_(0, ts + tables, ok.long())
        return _SortedRows(perm=perm, seg=seg, counts=counts)


@dataclass(frozen=True)
class _TouchedRows:
    """One dim's touched rows: table ``(U,)``, row ``(U,)``, summed gradient ``(U, D)``."""

    table: torch.Tensor
    row: torch.Tensor
    grad: torch.Tensor


@dataclass(frozen=True)
class _Step:
    """What every dim's share of a backward reads."""

    grad_out: torch.Tensor
    weights: torch.Tensor
    meta: list[torch.Tensor]
    loc: _Ids
    psw: torch.Tensor | None
    psw_grad: torch.Tensor | None
    prec: Precision
    batch: int

    def start(self, table: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """Flat element where each row starts ``(n,)``."""
        width, _ = _row_geometry(self.prec, self.meta[1])
        return self.meta[0][table] + row * width[table]

    def rows(self, table: torch.Tensor, row: torch.Tensor, d: int, aligned: bool) -> torch.Tensor:
        """Decoded ``(n, d)`` rows of tables of dim ``d``."""
        start = self.start(table, row)
        return _decoded_rows(self.weights, self.prec, start, table, table, d, True, aligned)

    def summed(
        self, order: _SortedRows, a: int, b: int, u: int, n_rows: int, d: int, aligned: bool
    ) -> _TouchedRows:
        """Sorted ids ``a:b`` (one dim ``d``): their rows' summed gradients, in order.

        Fills ``psw_grad`` at their positions when asked.
        """
        loc, meta = self.loc, self.meta
        pos = order.perm[a:b]  # (n,) positions, grouped by row, in position order
        seg = order.seg[a:b] - u  # (n,) the row of each among these n_rows
        feat, table, ids = loc.feat[pos], loc.table[pos], loc.ids[pos]
        bag = loc.bag[pos]
        # each bag's d gradient columns (F*B, d), then each id's bag: no (n, d) index
        bags = loc.offsets.numel() - 1
        bag_cols = meta[5][loc.bag_feat][:, None] + torch.arange(d, device=pos.device)
        bag_cols = bag_cols.clamp_(max=self.grad_out.shape[1] - 1)  # other dims' features
        sample = (torch.arange(bags, device=pos.device) % self.batch)[:, None]
        g = self.grad_out[sample, bag_cols].index_select(0, bag)  # (n, d)
        lengths = loc.offsets[1:] - loc.offsets[:-1]
        div = torch.where(meta[6][feat].bool(), lengths[bag].clamp(min=1), 1)
        g = g / div.unsqueeze(1)  # x / 1 is x: sum-pooled features keep their bits
        if self.psw is not None:
            if self.psw_grad is not None:
                self.psw_grad[pos] = (g * self.rows(table, ids, d, aligned)).sum(dim=1)
            g = g * self.psw[pos, None]
        summed = torch.zeros(n_rows, d, device=g.device).index_add_(0, seg, g)  # (U, d)
        u_table = torch.zeros(n_rows, dtype=torch.int64, device=g.device).scatter_(0, seg, table)
        u_row = torch.zeros(n_rows, dtype=torch.int64, device=g.device).scatter_(0, seg, ids)
        return _TouchedRows(table=u_table, row=u_row, grad=summed)


def _update_rows(
    step: _Step,
    touched: _TouchedRows,
    states: list[torch.Tensor],
    state_offsets: list[torch.Tensor],
    kind: OptimizerKind,
    spec: SparseOptimizerSpec,
    rounding: list[int],
    d: int,
    aligned: list[bool],
) -> None:
    """Decode, apply ``OPTIM_RULES[kind]``, encode and write one dim's touched rows.

    ``aligned``: whether the rows', then each state's, starts are multiples of their
    widths (whole-row gathers and writes).
    """
    meta, prec = step.meta, step.prec
    t, r = touched.table, touched.row
    start = step.start(t, r)
    w = step.rows(t, r, d, aligned[0])  # (U, d)
    names = list(state_layout(kind, d).items())
    st_start = [o[t] + r * sw for o, (_, sw) in zip(state_offsets, names)]
    st = {
        name: _gather_rows(s, at, sw, al)
        for (name, sw), s, at, al in zip(names, states, st_start, aligned[1:])
    }
    OPTIM_RULES[kind](w, touched.grad, st, spec, spec.lr)
    stochastic, seed, iteration = rounding
    noise = None
    if stochastic and prec is not Precision.FP32:
        noise = rounding_noise(seed, iteration, meta[7][t] + r, meta[8][t], d)
    encoded = encode_rows(w, prec, stochastic=bool(stochastic), noise=noise)
    _scatter_rows(step.weights, start, _width(prec, d), aligned[0], encoded)
    for (name, sw), s, at, al in zip(names, states, st_start, aligned[1:]):
        _scatter_rows(s, at, sw, al, st[name])
