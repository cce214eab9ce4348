"""The inference commands of ``tetrarec``: export, predict, quantize, serve.

Parsing and printing only: the work is ``tetrarec.inference``'s (imported when a command
runs, so that ``tetrarec --help`` loads no model code).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from tetrarec.cli.common import at_least_one, write_json

__all__ = ["INFERENCE_COMMANDS", "add_inference_commands"]


def add_inference_commands(sub: Any) -> None:
    """Add ``export``, ``predict``, ``quantize`` and ``serve`` to the subparsers ``sub``."""
    _add_export(sub)
    _add_predict(sub)
    _add_quantize(sub)
    _add_serve(sub)


# --- tetrarec export and predict (inference) ------------------------------------------------


def _add_export(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="export a checkpoint (one-process or sharded) as a model directory",
        description="Write the model of a training checkpoint (any world size and plan; "
        "cached and SSD tables included) as a self-contained model directory: safetensors "
        "tensors (every table whole, FP32) and a checked JSON manifest. Load it with "
        "tetrarec.inference.load, score with tetrarec predict.",
    )
    export.add_argument("--checkpoint", required=True, type=Path, help="a checkpoint directory")
    export.add_argument("--output", required=True, type=Path, metavar="MODEL_DIR")
    export.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    export.add_argument("--json", metavar="PATH", help="write the summary as JSON")


def _export(args: argparse.Namespace) -> int:
    from tetrarec.inference.export import export_checkpoint

    model = export_checkpoint(args.checkpoint, args.output, progress=not args.no_progress)
    source, manifest = model.manifest.source, model.manifest
    size = sum(int(f["bytes"]) for f in manifest.files.values())
    print(
        f"exported {len(manifest.tables)} tables, {size:,} bytes -> {args.output} "
        f"(step {source['step']}, world size {source['world_size']})"
    )
    write_json(
        args.json,
        {
            "output": str(args.output),
            "tables": len(manifest.tables),
            "bytes": size,
            "step": source["step"],
            "world_size": source["world_size"],
            "content_hash": manifest.content_hash,
        },
    )
    return 0


def _add_predict(sub: Any) -> None:
    predict = sub.add_parser(
        "predict",
        help="score files with an exported model",
        description="Score every row of the input files with an exported model and write "
        "the row's index (or --id-column), its score (click probability) and its label, "
        "as parquet or csv. The files are read as the model's training run read its data "
        "(data.source, the column mapping, data.on_bad_line).",
    )
    predict.add_argument("--model", required=True, type=Path, metavar="MODEL_DIR")
    predict.add_argument("--input", nargs="+", required=True, metavar="FILE")
    predict.add_argument("--output", required=True, type=Path, metavar="FILE")
    predict.add_argument(
        "--format", choices=("parquet", "csv"), help="default: from the output's extension"
    )
    predict.add_argument("--batch-size", type=at_least_one, default=8192)
    predict.add_argument(
        "--source",
        choices=("criteo", "csv", "parquet"),
        help="read the input as this source (default: the model's data.source)",
    )
    predict.add_argument(
        "--on-bad-line", choices=("error", "skip"), help="default: the model's data.on_bad_line"
    )
    predict.add_argument("--id-column", metavar="NAME", help="write this input column as id")
    predict.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    predict.add_argument("--json", metavar="PATH", help="write the summary as JSON")


def _predict(args: argparse.Namespace) -> int:
    from tetrarec.inference import load
    from tetrarec.inference.predict import PredictSettings, predict_files

    summary = predict_files(
        load(args.model),
        PredictSettings(
            files=tuple(args.input),
            output=args.output,
            output_format=args.format,
            batch_size=args.batch_size,
            source=args.source,
            on_bad_line=args.on_bad_line,
            id_column=args.id_column,
            progress=not args.no_progress,
        ),
    )
    print(summary.summary())
    write_json(args.json, {"model": str(args.model), **summary.to_dict()})
    return 0


# --- tetrarec quantize (per-table precisions, the accuracy tool chain) ---------------------


def _table_precision(text: str) -> tuple[str, str]:
    """An argparse type: ``NAME=PRECISION``."""
    name, sep, precision = text.partition("=")
    if not sep or not name or not precision:
        raise argparse.ArgumentTypeError(f"expected NAME=PRECISION, got {text!r}")
    return name, precision


def _add_quantize(sub: Any) -> None:
    q = sub.add_parser(
        "quantize",
        help="quantize an exported model per table, measured against FP32 (or re-check one)",
        description="Store an exported model's tables in lower precisions and its dense "
        "layers in another format. With --eval/--eval-split the result is measured "
        "against the FP32 model (NE, AUC and calibration changes; each changed table "
        "alone); with --budget-ne it searches the lowest precision per table (FP32, "
        "FP16, INT8, INT4) that keeps the NE change within PCT percent. The report goes "
        "into the model's manifest, --json and --plot. --check re-measures a quantized "
        "model against its FP32 model on new rows.",
    )
    q.add_argument("--model", required=True, type=Path, help="the model directory to read")
    q.add_argument("--output", type=Path, help="the quantized model directory to write")
    q.add_argument(
        "--tables", metavar="PRECISION",
        help="every table's precision (fp16|int8|int4; a table it would store larger, such "
        "as a first-order term's dim-1 table, takes its smallest: FP16)",
    )  # fmt: skip
    q.add_argument(
        "--table", dest="table", action="append", default=[], type=_table_precision,
        metavar="NAME=PRECISION", help="one table's precision (repeatable; not searched)",
    )  # fmt: skip
    q.add_argument("--mlp", default="fp32", help="the dense layers' format (fp32, bf16, int8)")
    q.add_argument(
        "--activations", choices=("dynamic", "static"),
        help="of --mlp int8: static (the default) calibrates the ranges on batches of the "
        "run's training rows, so a row's score does not depend on its batch; dynamic "
        "quantizes per batch and needs no data",
    )  # fmt: skip
    q.add_argument(
        "--calibration-batches", type=at_least_one, default=8, metavar="N",
        help="with --activations static: batches of --batch-size training rows (default 8)",
    )  # fmt: skip
    q.add_argument(
        "--prune-min-count", type=int, default=0, metavar="K",
        help="prune the rows each table saw fewer than K times in the training rows (they "
        "read as zeros; 1: the rows never seen); counted over the run's training data",
    )  # fmt: skip
    ev = q.add_mutually_exclusive_group()
    ev.add_argument("--eval", nargs="+", metavar="FILE", help="evaluation data files")
    ev.add_argument("--eval-split", action="store_true", help="the run's evaluation split")
    q.add_argument("--budget-ne", type=float, metavar="PCT", help="NE change budget, percent")
    q.add_argument("--eval-rows", type=at_least_one, metavar="N", help="evaluate N rows at most")
    q.add_argument("--batch-size", type=at_least_one, default=8192, help="rows per scoring call")
    q.add_argument("--json", metavar="PATH", help="write the report (or the check) as JSON")
    q.add_argument("--plot", metavar="PNG", help="write the per-table NE against bytes plot")
    q.add_argument("--check", action="store_true", help="re-check --model against --reference")
    q.add_argument("--reference", type=Path, help="with --check: the FP32 model")
    q.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def _quantize_settings(args: argparse.Namespace) -> Any:
    from tetrarec.inference.accuracy_report import EvalSettings

    if not (args.eval or args.eval_split):
        return None
    return EvalSettings(
        files=tuple(args.eval or ()), eval_rows=args.eval_rows,
        batch_size=args.batch_size, progress=not args.no_progress,
    )  # fmt: skip


def _quantize(args: argparse.Namespace) -> int:
    from tetrarec.inference import load, save
    from tetrarec.inference.accuracy_report import (
        check_deployed,
        format_check,
        format_report,
        plot_report,
        quantize_to_report,
    )
    from tetrarec.inference.prune import training_dataset
    from tetrarec.inference.quantize import tables_at
    from tetrarec.inference.scoring import batches
    from tetrarec.types import Precision

    evaluation = _quantize_settings(args)
    if args.check:
        if args.reference is None or evaluation is None:
            raise ValueError("--check needs --reference MODEL and --eval FILES (or --eval-split)")
        check = check_deployed(
            args.model, args.reference, budget_ne_pct=args.budget_ne, evaluation=evaluation
        )
        print(format_check(check))
        write_json(args.json, check.to_dict())
        return 0 if check.holds else 1
    if args.output is None:
        raise ValueError("give --output DIR (the quantized model to write), or --check")
    if args.budget_ne is not None and args.tables:
        raise ValueError("--tables and --budget-ne both choose every table: give one")
    if (args.budget_ne is not None or args.plot) and evaluation is None:
        raise ValueError(
            "--budget-ne and --plot need evaluation rows: --eval FILES or --eval-split"
        )
    if args.activations and args.mlp != "int8":
        raise ValueError(f"--activations applies to --mlp int8, not --mlp {args.mlp}")
    activations = args.activations or ("static" if args.mlp == "int8" else None)
    settings = {"activations": activations} if activations else {}
    model = load(args.model)
    tables = tables_at(model, Precision.parse(args.tables)) if args.tables else {}
    tables.update({name: Precision.parse(p) for name, p in args.table})
    calibration = None
    if activations == "static":
        try:
            rows = training_dataset(model)
        except (ValueError, FileNotFoundError) as e:  # DataError is a ValueError
            raise ValueError(
                f"static INT8 activations calibrate on the run's training rows, which cannot "
                f"be read ({e}); give --activations dynamic (no calibration data)"
            ) from e
        calibration = list(
            itertools.islice(batches(rows, batch_size=args.batch_size), args.calibration_batches)
        )
    out, report = quantize_to_report(
        model, tables=tables, mlp=args.mlp, mlp_settings=settings,
        budget_ne_pct=args.budget_ne, evaluation=evaluation,
        prune_min_count=args.prune_min_count, calibration=calibration,
    )  # fmt: skip
    save(out, args.output)
    if report is None:
        print(f"model size {out.nbytes():,} bytes ({out.nbytes() / model.nbytes():.3f}x FP32)")
    else:
        print(format_report(report))
        write_json(args.json, report)
        if args.plot:
            plot_report(report, args.plot)
            print(f"wrote {args.plot}")
    print(f"wrote {args.output}")
    return 0


# --- tetrarec serve (HTTP scoring) --------------------------------------------------------


def _add_serve(sub: Any) -> None:
    # Defaults are ServeSettings' (None here: the command's parser imports no server).
    serve = sub.add_parser("serve", help="serve an exported model over HTTP (JSON scoring)")
    serve.add_argument("--model", required=True, type=Path, help="the model directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument(
        "--max-batch", type=at_least_one, help="most rows per model call (default 4096)",
    )  # fmt: skip
    serve.add_argument(
        "--max-wait-ms", type=float,
        help="longest wait for more requests to batch with (default 2)",
    )  # fmt: skip
    serve.add_argument(
        "--no-batching", action="store_true", help="score each request in its own model call"
    )
    serve.add_argument("--threads", type=at_least_one, help="torch threads for the model")
    serve.add_argument(
        "--max-body-bytes", type=at_least_one,
        help="largest request body (default 16 MiB; 413 beyond)",
    )  # fmt: skip
    serve.add_argument(
        "--max-rows", type=at_least_one, help="most rows per request (default 4096; 413 beyond)",
    )  # fmt: skip


def _serve(args: argparse.Namespace) -> int:
    from tetrarec.inference import load
    from tetrarec.inference.serve import ServeSettings, run_server

    given = {
        "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms,
        "threads": args.threads,
        "max_body_bytes": args.max_body_bytes,
        "max_rows": args.max_rows,
    }
    settings = ServeSettings(
        batching=not args.no_batching, **{k: v for k, v in given.items() if v is not None}
    )
    model = load(args.model)

    def ready(url: str) -> None:
        print(f"serving {args.model} (model {model.manifest.content_hash}) on {url}", flush=True)

    run_server(model, settings, host=args.host, port=args.port, on_ready=ready)
    print("tetrarec serve: stopped", flush=True)
    return 0


#: The inference commands' runners, by name (``tetrarec.cli``'s table takes them in).
INFERENCE_COMMANDS = {
    "export": _export,
    "predict": _predict,
    "quantize": _quantize,
    "serve": _serve,
}
