"""Real Criteo rows: tetrarec's DLRM against a logistic regression on the same split.

Trains the Criteo-Kaggle-shaped DLRM (13 dense, 26 tables, bottom 512-256-64, dot
interaction, top 512-256-1; smaller tables, since the sample has 8,000 training rows) on
lines 1-8000 of the shared Criteo Kaggle sample and evaluates on lines 8001-12584. In
the same run, a logistic regression (torch) on the same features - the 13 transformed
dense values plus the hashed one-hot categoricals, i.e. the same hashed ids as the DLRM's
tables - is trained on the same rows and evaluated on the same rows. Reports AUC, log
loss and NE for both; there is no threshold.

    python benchmarks/bench_criteo_real.py [--epochs 1] [--json out.json]
    tetrarec bench criteo_real --smoke
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _harness import describe_run, kernel_summary, print_table, write_json

from tetrarec.config import RunConfig
from tetrarec.data import build_datasets
from tetrarec.sparse import Batch, offsets_from_lengths, slice_batch
from tetrarec.train import build_tables, compute_metrics, train

DATA = (
    Path(__file__).resolve().parents[1].parent
    / "shared/data/criteo-kaggle-dac-sample/criteo_kaggle_dac_sample.tsv.gz"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--train-rows", type=int, default=8000, help="lines 1..N train")
    p.add_argument("--eval-rows", type=int, default=12584, help="lines N+1..M evaluate")
    p.add_argument("--rows-per-table", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--epochs", type=int, default=1, help="passes over the training rows, both models"
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--embedding", choices=("reference", "fused"), default="fused")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args()


def run_config(args: argparse.Namespace) -> RunConfig:
    steps_per_epoch = args.train_rows // args.batch
    bottom = "[512, 256, 64]" if not args.smoke else "[16, 8]"
    top = "[512, 256, 1]" if not args.smoke else "[16, 1]"
    return RunConfig().with_overrides(
        [
            "data.source=criteo",
            f"data.train_path=[{str(args.data)!r}]",
            f"data.train_rows=[0, {args.train_rows}]",
            f"data.eval_rows=[{args.train_rows}, {args.eval_rows}]",
            f"data.batch_size={args.batch}",
            "data.eval_batch_size=4096",
            "model.num_sparse=26",
            f"model.num_embeddings={args.rows_per_table}",
            f"model.embedding={args.embedding}",
            f"model.dlrm.bottom_mlp={bottom.replace('64]', f'{args.dim}]')}",
            f"model.dlrm.top_mlp={top}",
            "optim.dense=adagrad",
            "optim.dense_lr=0.01",
            "optim.sparse.kind=rowwise_adagrad",
            "optim.sparse.lr=0.05",
            f"train.steps={args.epochs * steps_per_epoch}",
            f"train.eval_every={steps_per_epoch}",
            f"train.threads={args.threads}",
            "train.log_every=0",
            "train.seed=0",
        ]
    )


class LogisticRegression(torch.nn.Module):
    """``logit = w . dense + sum_f v_f[id_f] + b``: one weight per hashed id per table."""

    def __init__(self, num_dense: int, table_rows: tuple[int, ...]) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(num_dense, 1)
        self.offsets = torch.tensor([0, *np.cumsum(table_rows)[:-1].tolist()])
        self.ids = torch.nn.EmbeddingBag(int(sum(table_rows)), 1, mode="sum")
        torch.nn.init.zeros_(self.ids.weight)

    def forward(self, batch: Batch) -> torch.Tensor:
        sf = batch.sparse
        f, b = len(sf.keys), sf.batch_size
        per_key = sf.lengths.view(f, b).sum(1)  # (F,) ids of each feature
        ids = sf.values.long() + torch.repeat_interleave(self.offsets, per_key)  # (N,)
        bags = self.ids(ids, offsets_from_lengths(sf.lengths)[:-1])  # (F*B, 1) key-major
        return self.dense(batch.dense).squeeze(1) + bags.view(f, b).sum(0)  # (B,)


def train_logreg(
    train_b: Batch, args: argparse.Namespace, rows: tuple[int, ...]
) -> LogisticRegression:
    torch.manual_seed(0)
    model = LogisticRegression(train_b.dense.shape[1], rows)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    n = train_b.batch_size
    rng = np.random.default_rng(0)
    for _ in range(args.epochs):
        perm = rng.permutation(n // args.batch)
        for i in perm:
            mb = slice_batch(train_b, int(i) * args.batch, (int(i) + 1) * args.batch)
            loss = F.binary_cross_entropy_with_logits(model(mb), mb.labels)
            loss = loss + 1e-5 * model.ids.weight.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.train_rows, args.eval_rows, args.rows_per_table, args.epochs = 512, 768, 1000, 1
        args.batch = 128
    if not args.data.is_file():
        raise SystemExit(f"bench_criteo_real: data file {args.data} not found")
    config = run_config(args)
    t0 = time.perf_counter()
    result = train(config.with_overrides(["train.progress=false"]))
    dlrm_s = time.perf_counter() - t0
    assert result.final is not None

    train_ds, eval_ds = build_datasets(config.data, build_tables(config.model))
    train_b = train_ds.read(np.arange(train_ds.num_samples))
    eval_b = eval_ds.read(np.arange(eval_ds.num_samples))
    t0 = time.perf_counter()
    logreg = train_logreg(train_b, args, config.model.table_rows)
    with torch.no_grad():
        lr_metrics = compute_metrics(logreg(eval_b), eval_b.labels)
    lr_s = time.perf_counter() - t0

    rows = [
        {
            "impl": "tetrarec-dlrm",
            **result.final.to_dict(),
            "wall_s": dlrm_s,
            "samples_per_s": result.samples_per_s,
            "kernels": kernel_summary()["kernels"],
        },
        {"impl": "logistic-regression", **lr_metrics.to_dict(), "wall_s": lr_s},
    ]
    for r in rows:
        r["auc_minus_logreg"] = r["auc"] - lr_metrics.auc
    print_table(
        rows,
        [
            "impl",
            "auc",
            "log_loss",
            "ne",
            "calibration",
            "accuracy",
            "num_samples",
            "wall_s",
            "auc_minus_logreg",
        ],
    )
    print(describe_run())
    per_epoch = [{"step": s, "auc": m.auc, "log_loss": m.log_loss} for s, m in result.evals]
    print("DLRM per epoch:", ", ".join(f"step {e['step']}: AUC {e['auc']:.4f}" for e in per_epoch))
    write_json(args.json, {**vars(args), "data": str(args.data), "dlrm_evals": per_epoch}, rows)


if __name__ == "__main__":
    main()
