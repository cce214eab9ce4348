"""Local improvement of a greedy placement: moves and swaps of whole tables.

While it lowers the slowest rank's time, a table held whole on one rank (a type whose
cost terms say ``Split.WHOLE``, not replicated, over the world: table-wise) moves off
the slowest rank to the rank where the new slowest time is lowest (``improve``); when
no single move helps, two such tables swap between the slowest rank and a less loaded
one (``swap``: the classic 2-exchange after LPT). Every step keeps every memory limit.
"""

from __future__ import annotations

import numpy as np

from tetrarec.planner.cost import Option
from tetrarec.planner.inputs import PlannerInputs
from tetrarec.planner.partition import Evaluation, RankLoads
from tetrarec.sharding.strategy import Span, Split

__all__ = ["SWAP_PARTNERS", "SWAP_ROUNDS", "Chosen", "improve", "movable", "swap"]

#: Each placed table: (its option, its evaluation, the reason, how many candidates fit).
Chosen = dict[str, tuple[Option, Evaluation, str, int]]


def movable(option: Option) -> bool:
    """Whether a table stored as ``option`` is one whole shard that may sit on any rank."""
    terms = option.terms
    return (
        terms.split is Split.WHOLE
        and terms.span is Span.WORLD
        and not terms.replicated
        and option.blocks == 1
    )


def improve(st: RankLoads, inputs: PlannerInputs, chosen: Chosen) -> None:
    """Move whole tables off the slowest rank while that lowers the slowest time."""
    for _ in range(2 * len(chosen)):
        times = st.times()
        worst = int(np.argmax(times))
        current = float(times[worst])
        best_move: tuple[float, str, int] | None = None
        for name in sorted(chosen):
            opt, ev, _, _ = chosen[name]
            if not movable(opt) or ev.ranks != (worst,):
                continue
            st.add((worst,), ev.cost, -1.0)
            free = st.cap - st.mem
            need = np.asarray([*ev.cost.memory, ev.cost.fast_rows])[:, None]
            fits = (free >= need).all(axis=0)
            base = st.times()  # without the table
            c = ev.cost
            moved = (
                st.lookup
                + c.lookup_s
                + np.maximum(st.cin + st.u_in + c.bytes_in, st.cout + st.u_out + c.bytes_out)
                * st.spb
                + st.fixed(st.groups)
            )
            top = np.sort(base)[::-1]
            for r in (int(x) for x in np.flatnonzero(fits)):
                if r == worst:
                    continue
                others = float(top[1] if base[r] == top[0] else top[0])
                new = max(others, float(moved[r]))
                if new < current - 1e-12 and (best_move is None or new < best_move[0]):
                    best_move = (new, name, r)
            st.add((worst,), ev.cost)
        if best_move is None:
            return
        _, name, r = best_move
        opt, ev, reason, n = chosen[name]
        st.add((worst,), ev.cost, -1.0)
        st.add((r,), ev.cost)
        ev.ranks = (r,)
        chosen[name] = (opt, ev, reason + f"; moved from rank {worst} to balance", n)


#: Ranks (least loaded first) whose whole tables the slowest rank's may swap with.
SWAP_PARTNERS = 4
#: Swap rounds at most (each one strictly lowers the slowest rank's time).
SWAP_ROUNDS = 256


def swap(st: RankLoads, chosen: Chosen) -> None:
    """Swap whole tables between the slowest rank and a less loaded one.

    A swap is taken while it lowers the slowest time and every memory limit holds.
    Moves alone stop when no single table fits the gap between two ranks; a swap moves
    only the difference of two tables' costs (the classic 2-exchange after LPT).
    """
    on: dict[int, list[str]] = {}
    for name in sorted(chosen):
        opt, ev, _, _ = chosen[name]
        if movable(opt):
            on.setdefault(ev.ranks[0], []).append(name)
    for _ in range(SWAP_ROUNDS):
        times = st.times()
        worst = int(np.argmax(times))
        current = float(times[worst])
        partners = [int(r) for r in np.argsort(times, kind="stable")[:SWAP_PARTNERS]]
        best: tuple[float, str, str, int] | None = None
        for a in on.get(worst, []):
            ca = chosen[a][1].cost
            for r in partners:
                if r == worst:
                    continue
                for b in on.get(r, []):
                    cb = chosen[b][1].cost
                    if (
                        cb.lookup_s >= ca.lookup_s
                        and cb.bytes_in >= ca.bytes_in
                        and cb.bytes_out >= ca.bytes_out
                    ):
                        continue  # b costs at least what a does: the slowest cannot gain
                    st.add((worst,), ca, -1.0)
                    st.add((r,), cb, -1.0)
                    st.add((worst,), cb)
                    st.add((r,), ca)
                    fits = bool((st.mem <= st.cap + 1e-6).all())
                    new = float(st.times().max())
                    st.add((worst,), cb, -1.0)
                    st.add((r,), ca, -1.0)
                    st.add((worst,), ca)
                    st.add((r,), cb)
                    if fits and new < current - 1e-12 and (best is None or new < best[0]):
                        best = (new, a, b, r)
        if best is None:
            return
        _, a, b, r = best
        ca, cb = chosen[a][1].cost, chosen[b][1].cost
        st.add((worst,), ca, -1.0)
        st.add((r,), cb, -1.0)
        st.add((worst,), cb)
        st.add((r,), ca)
        for name, src, dst in ((a, worst, r), (b, r, worst)):
            opt, ev, reason, n = chosen[name]
            ev.ranks = (dst,)
            chosen[name] = (opt, ev, reason + f"; swapped from rank {src} to rank {dst}", n)
        on[worst] = sorted([*(x for x in on[worst] if x != a), b])
        on[r] = sorted([*(x for x in on[r] if x != b), a])
