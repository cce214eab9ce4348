"""Portable pure-PyTorch table-batched lookup and fused backward + optimizer.

The definition: the oracle the compiled kernels and the batched portable path
(``reference_batched.py``) are tested against, bit for bit. The per-table loop here is
what the CPU runs when no compiled kernel is available (no compiler, or
``TETRAREC_KERNELS=reference``); other devices run ``reference_batched``'s forward and
backward (the same bits, no host reads in the step, but several times slower on a CPU,
whose caches its full-batch temporaries overflow) and this module's other functions.
They take exactly the arguments of the ``tetrarec::`` ops in ``ops.py`` (see there for
the layout of each argument).

Backward, per table::

    per-id grads  g_i = grad_out[bag(i), cols(f)] * psw_i (/ L for mean)   (n, D)
    group ids     stable sort (deterministic) or torch.unique
    sum per row   index_add_ in sorted order                              (U, D)
    update        decode rows -> OPTIM_RULES[kind] -> encode rows, in place
"""

from __future__ import annotations

import functools

import torch

from tetrarec.embedding import SparseOptimizerSpec
from tetrarec.kernels.optim_rules import OPTIM_RULES, state_layout
from tetrarec.kernels.quant import decode_rows, encode_rows, row_width
from tetrarec.sparse import offsets_from_lengths
from tetrarec.types import OptimizerKind, Precision

__all__ = [
    "backward_update",
    "dot_interaction_backward",
    "dot_interaction_bf16_forward",
    "dot_interaction_forward",
    "load_rows",
    "pooled_forward",
    "rounding_noise",
    "row_gradient_shares",
    "store_rows",
    "summed_row_gradients",
    "table_view",
]


def table_view(
    weights: torch.Tensor, precision: Precision, offset: int, rows: int, dim: int
) -> torch.Tensor:
    """``(rows, row_width)`` view of one table inside the flat storage ``weights``."""
    width = row_width(precision, dim)
    return weights[offset : offset + rows * width].view(rows, width)


def _feature_starts(offsets: torch.Tensor, batch: int, num_features: int) -> list[int]:
    """``(F+1,)`` first value of each feature (key-major ``offsets`` of ``F * batch`` bags).

    A batch of no samples (a rank's share of a short last batch) has no values at all.
    """
    if batch == 0:
        return [0] * (num_features + 1)
    starts: list[int] = offsets[::batch].tolist()
    return starts


def _bags(offsets: torch.Tensor, f: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bag lengths ``(B,)`` of feature ``f`` and the bag of each of its ids ``(n,)``."""
    seg = offsets[f * batch : (f + 1) * batch + 1]
    lengths = seg[1:] - seg[:-1]
    bag = torch.repeat_interleave(torch.arange(batch, device=offsets.device), lengths)
    return lengths, bag


def _check_batch(
    meta: list[list[int]],
    where: str,
    what: str,
    width: int,
    batch: int,
    offsets: torch.Tensor,
    values: torch.Tensor,
    psw: torch.Tensor | None,
) -> None:
    """Raise as the compiled kernel's ``check_batch`` does for a batch off the layout.

    ``width`` is the number of columns of ``what`` (the output or the gradient).

    Raises:
        RuntimeError: for a negative length, lengths of another count than ``F * batch``,
            fewer columns than the store's features need, or fewer ids (or per-id
            weights) than the lengths add up to.
    """
    dims, feat_table, feat_cols = meta[1], meta[4], meta[5]
    features, n_lengths = len(feat_table), offsets.numel() - 1  # offsets: (lengths + 1,)
    negative = (offsets[1:] < offsets[:-1]).nonzero()
    if negative.numel():
        i = int(negative[0])
        raise RuntimeError(
            f"tetrarec tbe: bag length {i} is {int(offsets[i + 1] - offsets[i])} "
            "(lengths must be >= 0)"
        )
    if n_lengths != features * batch:
        raise RuntimeError(
            f"tetrarec tbe {where}: lengths must have F*B = {features}*{batch} entries, "
            f"got {n_lengths}"
        )
    cols = max((feat_cols[f] + dims[t] for f, t in enumerate(feat_table) if t >= 0), default=0)
    if width < cols:
        raise RuntimeError(
            f"tetrarec tbe {where}: {what} has {width} columns, the features need {cols}"
        )
    ids = int(offsets[-1])
    if ids != values.numel():
        raise RuntimeError(
            f"tetrarec tbe {where}: the lengths add up to {ids} ids, values holds {values.numel()}"
        )
    if psw is not None and ids != psw.numel():
        raise RuntimeError(
            f"tetrarec tbe {where}: the lengths add up to {ids} ids, the per-id weights hold "
            f"{psw.numel()}"
        )


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

    Returns:
        ``(2,)`` int64 ``[feature, id]`` of the first out-of-range id, ``[-1, -1]`` if
        none (checked only when ``check_bounds``).
    """
    prec = Precision(precision)
    offsets = offsets_from_lengths(lengths.long())
    host = [m.tolist() for m in meta[:7]]
    w_off, dims, rows, _, feat_table, feat_cols, feat_mean = host
    batch = out.shape[0]
    _check_batch(host, "forward", "out", out.shape[1], batch, offsets, values, per_sample_weights)
    starts = _feature_starts(offsets, batch, len(feat_table))  # (F+1,)
    for f, t in enumerate(feat_table):
        if t < 0:
            continue
        ids = values[starts[f] : starts[f + 1]].long()
        if check_bounds and ids.numel():
            lo, hi = (int(x) for x in torch.aminmax(ids))
            if lo < 0 or hi >= rows[t]:
                # The smallest bad id of the first such feature, as the compiled kernel
                # reports it (whatever the threads' order).
                bad = lo if lo < 0 else int(ids[ids >= rows[t]].min())
                return torch.tensor([f, bad], dtype=torch.int64)
        d = dims[t]
        emb = decode_rows(table_view(weights, prec, w_off[t], rows[t], d)[ids], prec, d)
        if per_sample_weights is not None:
            emb = emb * per_sample_weights[starts[f] : starts[f + 1], None]
        lengths, bag = _bags(offsets, f, batch)
        pooled = torch.zeros(batch, d, device=out.device).index_add_(0, bag, emb)  # (B, D)
        if feat_mean[f]:
            pooled /= lengths.clamp(min=1).unsqueeze(1)
        out[:, feat_cols[f] : feat_cols[f] + d] = pooled
    return torch.tensor([-1, -1], dtype=torch.int64)


_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """``x mod 2^64`` as the int64 with those bits."""
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bits (wraps mod 2^64, as the C++ ``mix64``)."""
    z = z + _signed(_GOLDEN)
    z = (z ^ _lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _lsr(z, 31)


def rounding_noise(
    seed: int,
    iteration: int,
    row_keys: torch.Tensor,
    col_start: int | torch.Tensor,
    dim: int,
) -> torch.Tensor:
    """Uniform ``(U, dim)`` draws in (0, 1) for stochastic rounding of ``U`` rows.

    Counter-based, as in the C++ kernel (the same bits): a function of the step's
    ``(seed, iteration)``, the row's global key and the global column only, never of
    which other rows the step touched or of how the table is sharded. Integer tensor
    arithmetic on the rows' device (no host round trip).

    Args:
        seed: the collection's seed.
        iteration: the backward pass's number.
        row_keys: ``(U,)`` rounding keys of the rows (``TableSlice.row_key() + row``).
        col_start: global column of the rows' first column: one for all rows, or a
            ``(U,)`` int64 tensor, one per row.
        dim: columns.
    """
    step = _signed((seed % 2**64) * _GOLDEN ^ (iteration % 2**64))
    keys = row_keys.long()
    key = _mix64(step ^ (keys * _signed(0xA24BAED4963EE407)))  # (U,)
    m32 = 0xFFFFFFFF
    lo, hi = (key & m32)[:, None], _lsr(key, 32)[:, None]
    first = torch.as_tensor(col_start, device=keys.device).long().reshape(-1, 1)  # (1|U, 1)
    cols = torch.arange(dim, device=keys.device)[None, :] + first  # (1|U, dim)
    z = (lo + (cols & m32) * 0x9E3779B9) & m32  # uint32 arithmetic in int64
    z = z ^ (z >> 16)
    z = (z * 0x85EBCA6B) & m32
    z = z ^ (z >> 13)
    z = (z * 0xC2B2AE35) & m32
    z = z ^ (z >> 16)
    bits16 = ((z ^ hi) >> 8) & 0xFFFF
    return (bits16.to(torch.float32) + 0.5) * (1.0 / 65536.0)


def _per_id_grads(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[list[int]],
    t: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    psw_grad: torch.Tensor | None,
    prec: Precision,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids ``(n,)`` of table ``t`` over its features and their gradients ``(n, D)``."""
    w_off, dims, rows, _, feat_table, feat_cols, feat_mean = meta[:7]
    batch, d = grad_out.shape[0], dims[t]
    starts = _feature_starts(offsets, batch, len(feat_table))
    all_ids, all_grads = [], []
    for f in (f for f, tt in enumerate(feat_table) if tt == t):
        s, e = starts[f], starts[f + 1]
        ids = values[s:e].long()
        lengths, bag = _bags(offsets, f, batch)
        g = grad_out[bag, feat_cols[f] : feat_cols[f] + d]  # (n, D)
        if feat_mean[f]:
            g = g / lengths.clamp(min=1)[bag].unsqueeze(1)
        if psw is not None:
            if psw_grad is not None:
                emb = decode_rows(table_view(weights, prec, w_off[t], rows[t], d)[ids], prec, d)
                psw_grad[s:e] = (g * emb).sum(dim=1)
            g = g * psw[s:e, None]
        all_ids.append(ids)
        all_grads.append(g)
    return torch.cat(all_ids), torch.cat(all_grads)


def _sum_duplicates(
    ids: torch.Tensor, grads: torch.Tensor, deterministic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids ``(U,)`` and their summed gradients ``(U, D)``."""
    if deterministic:
        # Stable sort fixes the order in which duplicates are added.
        sorted_ids, perm = torch.sort(ids, stable=True)
        uniq, inverse = torch.unique_consecutive(sorted_ids, return_inverse=True)
        grads = grads[perm]
    else:
        uniq, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(uniq.numel(), grads.shape[1], device=grads.device)
    return uniq, summed.index_add_(0, inverse, grads)


def summed_row_gradients(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    t: int,
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Table ``t``'s touched rows ``(U,)`` (sorted) and their summed gradients ``(U, D)``.

    The gradient ``backward_update`` applies (mean pooling and per-id weights included),
    duplicates summed in position order; nothing is updated.
    """
    host = [m.tolist() for m in meta]
    offsets = offsets_from_lengths(lengths.long())
    ids, grads = _per_id_grads(
        grad_out, weights, host, t, values, offsets, per_sample_weights, None, Precision(precision)
    )
    return _sum_duplicates(ids, grads, deterministic=True)


def row_gradient_shares(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    meta: list[torch.Tensor],
    t: int,
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    weight_decay: float,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Table ``t``'s touched rows ``(U,)`` (sorted) and ``sum_d g'_d^2`` per row ``(U,)``.

    ``g' = g + weight_decay * w``: ``g`` the summed gradient of ``summed_row_gradients``,
    ``w`` the row's current value (decoded). The squares are added in column order
    (``0 + g'_0^2 + g'_1^2 + ...``, as the compiled kernel's row-wise rules and its
    ``tbe_row_gradient_shares`` add them), so the result is bitwise the compiled op's.
    ``(g' * g').sum(1)`` adds in another order and may differ from it in the last bits
    (relative difference at most about ``2 * D * 2^-24``: every term is non-negative).

    Raises:
        RuntimeError: as the compiled op, for an id of table ``t`` outside the table.
    """
    host = [m.tolist() for m in meta]
    one_table = [*host[:4], [tt if tt == t else -1 for tt in host[4]], *host[5:]]
    offsets = offsets_from_lengths(lengths.long())
    batch, width = grad_out.shape
    _check_batch(
        one_table, "row shares", "grad_out", width, batch, offsets, values,
        per_sample_weights,
    )  # fmt: skip
    _check_ids_before_update(values, offsets, one_table, batch)
    prec = Precision(precision)
    uniq, g = summed_row_gradients(  # (U,), (U, D)
        grad_out, weights, meta, t, values, lengths, per_sample_weights, precision
    )
    if weight_decay:
        w_off, dims, rows = host[0][t], host[1][t], host[2][t]
        w = decode_rows(table_view(weights, prec, w_off, rows, dims)[uniq], prec, dims)
        g = g + weight_decay * w  # two roundings, as the kernel's g += wd * w (no FMA)
    share = torch.zeros(uniq.numel(), device=g.device)
    for d in range(g.shape[1]):  # column order: the kernel's sequential sum
        share = share + g[:, d] * g[:, d]
    return uniq, share


def _check_ids_before_update(
    values: torch.Tensor, offsets: torch.Tensor, meta: list[list[int]], batch: int
) -> None:
    """Raise as the compiled kernel does for an id outside its table, before any update.

    Without it a negative id would silently update a row from the table's end.

    Raises:
        RuntimeError: naming the feature (its index), the first id out of range in that
            feature's values (by position, as the compiled kernel) and the table's rows.
    """
    rows, feat_table = meta[2], meta[4]
    starts = _feature_starts(offsets, batch, len(feat_table))  # (F+1,)
    for f, t in enumerate(feat_table):
        ids = values[starts[f] : starts[f + 1]]
        if t < 0 or not ids.numel():
            continue
        lo, hi = (int(x) for x in torch.aminmax(ids.long()))
        if lo < 0 or hi >= rows[t]:
            first = int(ids[(ids < 0) | (ids >= rows[t])][0])  # by position, as the kernel
            raise RuntimeError(
                f"tetrarec tbe backward: feature {f} (its index in the feature order): "
                f"id {first} is outside its table of {rows[t]} rows"
            )


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

    Returns:
        ``(N,)`` gradient w.r.t. ``per_sample_weights`` (empty if none or not asked).
    """
    prec, kind = Precision(precision), OptimizerKind(optimizer)
    offsets = offsets_from_lengths(lengths.long())
    stochastic, seed, iteration, deterministic, want_psw_grad = flags
    lr, eps, beta1, beta2, weight_decay = hparams
    spec = SparseOptimizerSpec(
        kind=kind, lr=lr, eps=eps, beta1=beta1, beta2=beta2, weight_decay=weight_decay
    )
    host = [m.tolist() for m in meta]
    batch, width = grad_out.shape
    _check_batch(host, "backward", "grad_out", width, batch, offsets, values, per_sample_weights)
    _check_ids_before_update(values, offsets, host, batch)
    w_off, dims, rows = host[0], host[1], host[2]
    psw_grad = None
    if per_sample_weights is not None and want_psw_grad:
        psw_grad = torch.zeros_like(per_sample_weights)
    st_off = [o.tolist() for o in state_offsets]
    for t in sorted({t for t in host[4] if t >= 0}):
        args = (grad_out, weights, host, t, values, offsets, per_sample_weights, psw_grad, prec)
        uniq, g = _sum_duplicates(*_per_id_grads(*args), bool(deterministic))
        view = table_view(weights, prec, w_off[t], rows[t], dims[t])
        w = decode_rows(view[uniq], prec, dims[t])  # (U, D)
        names = list(state_layout(kind, dims[t]).items())
        st_views = [
            s[o[t] : o[t] + rows[t] * width].view(rows[t], width)
            for s, o, (_, width) in zip(states, st_off, names)
        ]
        st = {name: v[uniq] for (name, _), v in zip(names, st_views)}
        OPTIM_RULES[kind](w, g, st, spec, lr)
        noise = None
        if stochastic and prec is not Precision.FP32:
            noise = rounding_noise(seed, iteration, host[7][t] + uniq, host[8][t], dims[t])
        view[uniq] = encode_rows(w, prec, stochastic=bool(stochastic), noise=noise)
        for (name, _), v in zip(names, st_views):
            v[uniq] = st[name]
    if psw_grad is None:
        return torch.empty(0, device=grad_out.device)
    return psw_grad


# -- DLRM dot interaction ---------------------------------------------------------------
#
# Rows per sample: C_0 = dense (B, D), C_{f+1} = embeddings[:, f*D:(f+1)*D]; the output
# is [dense | <C_i, C_j> for i > j, row-major]. These are the oracle of the compiled
# kernel and what runs on other devices and dtypes.


@functools.cache
def _pair_maps(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the pairs' flat ``(i, j)`` cells ``(P,)`` and the map cell -> 1 + pair.

    The map ``(n*n,)`` is 0 on the diagonal; one gather through it builds ``G + G^T``.
    """
    rows, cols = torch.tril_indices(n, n, offset=-1)
    pairs = rows * n + cols
    sym_gather = torch.zeros(n * n, dtype=torch.int64)
    sym_gather[pairs] = torch.arange(1, pairs.numel() + 1)
    sym_gather[cols * n + rows] = torch.arange(1, pairs.numel() + 1)
    return pairs.to(device), sym_gather.to(device)


def _stack_rows(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    b, d = dense.shape
    n = embeddings.shape[1] // d + 1
    combined = dense.new_empty(b, n, d)  # (B, n, D)
    combined[:, 0] = dense
    combined[:, 1:] = embeddings.view(b, n - 1, d)
    return combined


def dot_interaction_forward(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """``(B, D), (B, F*D) -> (B, D + n(n-1)/2)`` with ``n = F + 1``: one bmm, one gather."""
    combined = _stack_rows(dense, embeddings)
    b, n, d = combined.shape
    pairs, _ = _pair_maps(n, dense.device)
    z = torch.bmm(combined, combined.transpose(1, 2)).view(b, n * n)  # (B, n*n)
    out = dense.new_empty(b, d + pairs.numel())
    out[:, :d] = dense
    out[:, d:] = z.index_select(1, pairs)
    return out


def dot_interaction_backward(
    grad_out: torch.Tensor, dense: torch.Tensor, embeddings: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad dense, grad embeddings)``: ``dC = (G + G^T) C``, one gather and one bmm.

    ``<C_i, C_j>`` touches both rows, so a pair's gradient goes to cells ``(i, j)`` and
    ``(j, i)``; a gather from ``[0 | pair grads]`` builds ``G + G^T`` (zero diagonal).
    """
    combined = _stack_rows(dense, embeddings)
    b, n, d = combined.shape
    _, sym_gather = _pair_maps(n, dense.device)
    padded = torch.cat((grad_out.new_zeros(b, 1), grad_out[:, d:]), dim=1)  # (B, 1 + P)
    sym = padded.index_select(1, sym_gather).view(b, n, n)
    grad_c = torch.bmm(sym, combined)  # (B, n, D)
    return grad_out[:, :d] + grad_c[:, 0], grad_c[:, 1:].reshape(b, (n - 1) * d)


#: Samples per step of ``dot_interaction_bf16_forward`` (bounds its (chunk, P, D) products).
_BF16_CHUNK = 128


def dot_interaction_bf16_forward(dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """The BF16 dot interaction's definition: ``[dense | <C_i, C_j> for i > j]``, FP32.

    The rows ``C = (dense, e_0, ..., e_{F-1})`` are rounded to BF16 (nearest, ties to
    even); each product of two BF16 values is exact in FP32; a pair's ``D`` products
    are summed in FP32 in a fixed pairwise tree (padded with zeros to a power of two,
    the first half added to the second until one term is left), the same on every
    device. ``dense`` is copied out unrounded. Inputs of any float dtype are read as
    FP32; the result is FP32.

    A compiled kernel sums the same exact products in another order, so it may differ
    from this by ``(D + log2 D + 2) * 2^-24 * sum_k |p_k|`` per output (each sum is
    within ``gamma_m * sum |p_k|`` of the exact one, ``m`` its longest chain of roundings).

    Raises:
        ValueError: if ``embeddings`` is not ``(B, F*D)`` for ``dense`` ``(B, D)``.
    """
    if (
        dense.dim() != 2
        or embeddings.dim() != 2
        or embeddings.shape[0] != dense.shape[0]
        or dense.shape[1] == 0
        or embeddings.shape[1] % dense.shape[1]
    ):
        raise ValueError(
            f"dot_interaction_bf16: embeddings must be (B, F*D) for dense (B, D), got "
            f"{tuple(embeddings.shape)} and {tuple(dense.shape)}"
        )
    x, e = dense.float(), embeddings.float()
    combined = _stack_rows(x, e).to(torch.bfloat16).float()  # (B, n, D)
    b, n, d = combined.shape
    width = 1 << max(d - 1, 0).bit_length()  # D padded to a power of two
    pairs, _ = _pair_maps(n, dense.device)
    rows, cols = pairs // n, pairs % n
    out = x.new_empty(b, d + pairs.numel())
    out[:, :d] = x
    for s0 in range(0, b, _BF16_CHUNK):
        c = combined[s0 : s0 + _BF16_CHUNK]
        prods = c.new_zeros(c.shape[0], pairs.numel(), width)  # (chunk, P, width)
        prods[..., :d] = c[:, rows] * c[:, cols]  # exact: 8-bit by 8-bit significands
        while prods.shape[-1] > 1:
            half = prods.shape[-1] // 2
            prods = prods[..., :half] + prods[..., half:]
        out[s0 : s0 + _BF16_CHUNK, d:] = prods[..., 0]
    return out


# -- rows between FP32 buffers and row stores (the mixed-precision cache) ------------------


def load_rows(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
) -> None:
    """``dst[dst_index[j]] = decode(src[src_index[j]])``: stored rows into FP32 rows.

    Args:
        src: ``(E, row_width)`` rows in ``precision``.
        src_index: ``(n,)`` int64 rows of ``src``.
        dst: ``(S, D)`` FP32 rows, written in place.
        dst_index: ``(n,)`` int64 distinct rows of ``dst``.
        precision: the rows' precision (``"fp32"`` ... ``"int4"``).
    """
    dim = dst.shape[1]
    dst[dst_index] = decode_rows(src[src_index], Precision(precision), dim)


def store_rows(
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    precision: str,
    flags: list[int],
) -> None:
    """``dst[dst_index[j]] = encode(src[src_index[j]])``: FP32 rows into stored rows.

    Stochastic rounding draws what ``backward_update`` would draw for row
    ``row_key + dst_index[j]`` at ``(seed, iteration)`` (``rounding_noise``).

    Args:
        src: ``(S, D)`` FP32 rows.
        src_index: ``(n,)`` int64 rows of ``src``.
        dst: ``(E, row_width)`` rows in ``precision``, written in place.
        dst_index: ``(n,)`` int64 distinct rows of ``dst``.
        precision: the stored rows' precision.
        flags: ``[stochastic, seed, iteration, row_key, col_start]``.
    """
    stochastic, seed, iteration, row_key, col_start = flags
    p = Precision(precision)
    w = src[src_index]  # (n, D)
    noise = None
    if stochastic and p is not Precision.FP32:
        noise = rounding_noise(seed, iteration, dst_index + row_key, col_start, w.shape[1])
    dst[dst_index] = encode_rows(w, p, stochastic=bool(stochastic), noise=noise)
