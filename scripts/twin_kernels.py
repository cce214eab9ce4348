"""Two builds of the CPU kernels timed in one process: the fused forward and update per format.

Loads the compiled extension of two source trees (``--old`` and ``--new`` csrc
directories, each already built: ``build_key`` names its cache directory) and calls their
``tbe_forward`` / ``tbe_backward_update`` alternately on the same rows, with the arguments
``tetrarec/kernels/ops.py`` passes, measuring CPU time (``time.thread_time``) on one
thread; prints min and median per call over the rounds, and each format's ratio to FP32
(new build). The machine may be shared: CPU time and alternation keep the comparison
fair, the min is the figure to quote.

Shapes (uniform ids, batch 2048, 26 tables): ``w64`` 26 x 200k x 64 rows, pooling 20;
``d16`` 26 x 100k x 16, pooling 1.

Example::

    python scripts/twin_kernels.py --old /tmp/csrc_old --formats fp32 int8 --optims sgd
    python scripts/twin_kernels.py --old /tmp/csrc_old --profile int4 sgd w64  # one build
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from tetrarec.embedding import SparseOptimizerSpec, TableConfig
from tetrarec.kernels import FusedEmbeddingBagCollection
from tetrarec.kernels._build import _build_dir, build_key, compiled_cpu_kernels

SHAPES = {"w64": (200_000, 64, 20), "d16": (100_000, 16, 1)}
B, F = 2048, 26


def load_build(csrc: Path) -> ModuleType:
    """The compiled module of source tree ``csrc`` from the build cache."""
    key = build_key(csrc)
    found = sorted(_build_dir(key).glob("*.so"))
    if not found:
        raise FileNotFoundError(f"{csrc}: no build in the cache (key {key}); build it first")
    spec = importlib.util.spec_from_file_location(f"tetrarec_cpu_{key}", found[0])
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collection(prec: str, optim: str, rows: int, dim: int) -> FusedEmbeddingBagCollection:
    """26 tables of ``rows`` x ``dim`` at ``prec``, optimizer ``optim``, stochastic rounding."""
    tables = [
        TableConfig(
            name=f"t{i}", num_embeddings=rows, dim=dim, precision=prec, feature_names=(f"f{i}",)
        )
        for i in range(F)
    ]
    return FusedEmbeddingBagCollection(tables, SparseOptimizerSpec(kind=optim, lr=0.01), seed=0)


def batch(rows: int, pooling: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform ids, ``pooling`` a bag: (values, lengths)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.full((F * B,), pooling, dtype=torch.int64)
    return torch.randint(0, rows, (F * B * pooling,), generator=g), lengths


def calls(ebc: FusedEmbeddingBagCollection, prec: str, optim: str, shape: str) -> dict:
    """The forward and update closures of one build over ``ebc``'s store 0."""
    rows, dim, pooling = SHAPES[shape]
    values, lengths = batch(rows, pooling)
    out = torch.empty(B, F * dim)
    grad = torch.randn(B, F * dim, generator=torch.Generator().manual_seed(2)) * 1e-2
    meta, offs = ebc._cached_meta(0)
    w, states = ebc._storage(0), ebc._states(0)
    hp = ebc.fused_optimizer.kernel_hparams()
    flags = [1, ebc.seed, 0, 1, 0]

    def fwd(ext: ModuleType) -> None:
        ext.tbe_forward(w, meta, values, lengths, None, out, prec, False)

    def bwd(ext: ModuleType) -> None:
        flags[2] += 1
        ext.tbe_backward_update(
            grad, w, meta, values, lengths, None, states, offs, optim, hp, prec, flags
        )

    return {"fwd": fwd, "bwd": bwd}


def twin(fn, exts: dict[str, ModuleType], rounds: int, n: int) -> dict[str, list[float]]:
    """Per-call CPU ms of ``fn(ext)`` for each build, alternating builds every round."""
    for ext in exts.values():
        fn(ext)  # warm: scratch buffers, pages
    ts: dict[str, list[float]] = {k: [] for k in exts}
    for _ in range(rounds):
        for k, ext in exts.items():
            t = time.thread_time()
            for _ in range(n):
                fn(ext)
            ts[k].append((time.thread_time() - t) / n * 1e3)
    return ts


def main() -> None:
    """Parse the arguments and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, required=True, help="csrc dir of the old build")
    p.add_argument("--new", type=Path, default=Path("tetrarec/kernels/csrc"))
    p.add_argument("--formats", nargs="+", default=["fp32", "fp16", "bf16", "int8", "int4"])
    p.add_argument("--optims", nargs="+", default=["sgd", "rowwise_adagrad", "adam"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile", nargs=3, metavar=("FORMAT", "OPTIM", "SHAPE"))
    p.add_argument("--seconds", type=float, default=20.0, help="--profile: how long")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.new.resolve() == Path("tetrarec/kernels/csrc").resolve():
        compiled_cpu_kernels()  # builds this checkout's sources if needed
    exts = {"old": load_build(a.old), "new": load_build(a.new)}
    if a.profile:
        prec, optim, shape = a.profile
        ebc = collection(prec, optim, *SHAPES[shape][:2])
        c = calls(ebc, prec, optim, shape)
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            c["fwd"](exts["new"])
            c["bwd"](exts["new"])
        return
    res: dict[tuple[str, str, str, str], dict[str, list[float]]] = {}
    for shape in a.shapes:
        for prec in a.formats:
            for i, optim in enumerate(a.optims):
                ebc = collection(prec, optim, *SHAPES[shape][:2])
                c = calls(ebc, prec, optim, shape)
                n = 3 if shape == "w64" else 20
                if i == 0:
                    res[(shape, prec, "forward", "")] = twin(c["fwd"], exts, a.rounds, n)
                res[(shape, prec, "update", optim)] = twin(c["bwd"], exts, a.rounds, n)
                del ebc, c
                row = [k for k in res if k[1] == prec and k[0] == shape]
                for k in row[-2 if i == 0 else -1 :]:
                    _print(k, res)
    print("\nratio to fp32 (min, new build | old build):")
    for (shape, prec, what, optim), ts in res.items():
        base = res.get((shape, "fp32", what, optim))
        if base is None:
            continue
        rn, ro = min(ts["new"]) / min(base["new"]), min(ts["old"]) / min(base["old"])
        print(f"{shape:4s} {prec:5s} {what:7s} {optim:16s} new {rn:5.2f}x  old {ro:5.2f}x")


def _print(k: tuple[str, str, str, str], res: dict) -> None:
    ts = res[k]
    o, n = min(ts["old"]), min(ts["new"])
    mo, mn = statistics.median(ts["old"]), statistics.median(ts["new"])
    print(
        f"{k[0]:4s} {k[1]:5s} {k[2]:7s} {k[3]:16s} old {o:7.2f} new {n:7.2f} ms "
        f"new/old {n / o:5.2f}  (medians {mo:7.2f} {mn:7.2f})",
        flush=True,
    )


if __name__ == "__main__":
    main()
