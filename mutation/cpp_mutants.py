"""Seeded bugs in the C++ kernels: does the kernel test suite catch each one?

Each mutant is a textual patch of one file under ``tetrarec/kernels/csrc/``. It is applied
to a COPY of the package (with ``tests/`` and ``pyproject.toml``) in a scratch
directory; the working tree is never modified. The copy is built with its own
``XDG_CACHE_HOME`` (its own kernel build directory) under ``TETRAREC_KERNELS=compiled``,
so a mutant that fails to build is reported as such and never turns the tests into
skips; then the kernel tests run against it with ``pytest -x``. A mutant is *killed*
when the tests fail, *survived* when they pass.

Usage (from the repository root; ``make mutants`` runs it after the Python tool)::

    .venv/bin/python mutation/cpp_mutants.py                 # all mutants
    .venv/bin/python mutation/cpp_mutants.py --list          # names and descriptions
    .venv/bin/python mutation/cpp_mutants.py --only adam_no_bias_correction1 --keep
    .venv/bin/python mutation/cpp_mutants.py --json out.json --tests tests/unit/kernels

Each build takes about a minute on 2 cores, each test run up to about a minute: the
whole list runs in roughly 40-60 minutes here. Exit status: 0 when the score (killed /
valid mutants) reaches ``--goal`` (default 0.9), else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = "tetrarec/kernels/csrc"


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One seeded bug: replace ``old`` (which must occur exactly once) by ``new``."""

    name: str
    file: str
    old: str
    new: str
    what: str


TBE = f"{CSRC}/tbe_cpu.cpp"
BWD = f"{CSRC}/tbe_cpu_backward.h"

MUTANTS = [
    # -- quantization levels and rounding -------------------------------------------------
    Mutant(
        "int_half_levels",
        TBE,
        "kLevels = (1 << Bits) - 1;",
        "kLevels = (1 << (Bits - 1)) - 1;",
        "INT8/INT4 rows use half the levels (127 / 7 steps)",
    ),
    Mutant(
        "int_clamp_one_level_short",
        TBE,
        "top = static_cast<float>(kLevels);",
        "top = static_cast<float>(kLevels - 1);",
        "integer codes clamped one level below the top",
    ),
    Mutant(
        "int_nearest_is_floor",
        TBE,
        "if (!sr) q = (q + 8388608.0f) - 8388608.0f;\n      const v16i c",
        "if (!sr) q = q;\n      const v16i c",
        "integer round-to-nearest truncates instead",
    ),
    Mutant(
        "int_stochastic_biased",
        TBE,
        "widen_u16x16(rnd + d), v16f) + 0.5f) * (1.0f / 65536.0f);",
        "widen_u16x16(rnd + d), v16f) + 0.5f) * (0.5f / 65536.0f);",
        "integer stochastic rounding draws u in [0, 0.5): biased down",
    ),
    Mutant(
        "int4_nibble_order",
        TBE,
        "store_low8x8(r + d / 2, (lo4 & 0x0F) | (hi4 << 4));",
        "store_low8x8(r + d / 2, (hi4 & 0x0F) | (lo4 << 4));",
        "INT4 encode writes the high nibble first (decode reads low first)",
    ),
    Mutant(
        "int_bias_from_max",
        TBE,
        "const uint16_t b = half_bits_down(lo);",
        "const uint16_t b = half_bits_down(lo + (hi - lo) / 64.0f);",
        "integer row bias is off by a fraction of a step",
    ),
    Mutant(
        "int_grid_bias_to_nearest",
        TBE,
        "const uint16_t b = half_bits_down(lo);",
        "const uint16_t b = half_bits(lo);",
        "integer row bias rounded to nearest: the row's min can fall below the grid",
    ),
    Mutant(
        "int_grid_scale_to_nearest",
        TBE,
        "const uint16_t s = half_bits_up(",
        "const uint16_t s = half_bits(",
        "integer row scale rounded to nearest: the row's max can fall above the grid",
    ),
    Mutant(
        "int_grid_no_saturation",
        TBE,
        "lo = std::min(std::max(lo, -65504.0f), 65504.0f);",
        "lo = lo;",
        "integer rows past FP16's range get an inf bias",
    ),
    Mutant(
        "fp16_nearest_truncates",
        TBE,
        "_mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT)",
        "_mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_ZERO)",
        "FP16 round-to-nearest (vector loop) truncates",
    ),
    Mutant(
        "fp16_stochastic_12_bits",
        TBE,
        "const v8u32 nrm = u + (r & 0x1FFFu);",
        "const v8u32 nrm = u + (r & 0x0FFFu);",
        "FP16 stochastic rounding (vector loop) adds 12 random bits, not 13: biased",
    ),
    Mutant(
        "fp16_stochastic_tail_short",
        TBE,
        "std::memcpy(p + d, lanes, n * sizeof(uint16_t));",
        "std::memcpy(p + d, lanes, (n - 1) * sizeof(uint16_t));",
        "FP16 stochastic rounding of a row's tail (dims past a multiple of 8) drops its "
        "last element (the tail goes through the vector lanes since the global rounding "
        "keys; round16's stochastic branch now runs only on CPUs without F16C)",
    ),
    Mutant(
        "fp16_subnormal_as_normal",
        TBE,
        "const v8u32 out = finite ? (small ? sub : nrm) : u;",
        "const v8u32 out = finite ? nrm : u;",
        "FP16 stochastic rounding ignores the subnormal range",
    ),
    Mutant(
        "bf16_stochastic_15_bits",
        TBE,
        "static_cast<uint16_t>((u + rnd[d]) >> 16)",
        "static_cast<uint16_t>((u + (rnd[d] >> 1)) >> 16)",
        "BF16 stochastic rounding adds 15 random bits, not 16: biased",
    ),
    # -- optimizer rules ------------------------------------------------------------------
    Mutant(
        "sgd_half_step",
        BWD,
        "w[d] -= A.lr * g[d];",
        "w[d] -= A.lr * g[d] * 0.5f;",
        "SGD takes half a step",
    ),
    Mutant(
        "weight_decay_on_gradient",
        BWD,
        "for (int64_t d = 0; d < D; ++d) g[d] += wd * w[d];",
        "for (int64_t d = 0; d < D; ++d) g[d] += wd * g[d];",
        "weight decay scales the gradient instead of adding wd * w",
    ),
    Mutant(
        "adagrad_eps_inside_sqrt",
        BWD,
        "w[d] -= A.lr * (g[d] / (std::sqrt(m[d]) + A.eps));",
        "w[d] -= A.lr * (g[d] / std::sqrt(m[d] + A.eps));",
        "Adagrad's eps inside the square root",
    ),
    Mutant(
        "adagrad_old_accumulator",
        BWD,
        "w[d] -= A.lr * (g[d] / (std::sqrt(m[d]) + A.eps));",
        "w[d] -= A.lr * (g[d] / (std::sqrt(m[d] - g[d] * g[d]) + A.eps));",
        "Adagrad divides by the accumulator before this step's g^2",
    ),
    Mutant(
        "rowwise_adagrad_sum_not_mean",
        BWD,
        "*m += sq[i] / static_cast<float>(D);",
        "*m += sq[i];",
        "row-wise Adagrad accumulates the sum of g^2, not the mean",
    ),
    Mutant(
        "rowwise_adagrad_interleaved_wrong_row",
        BWD,
        "for (int i = 0; i < kBatch; ++i) sq[i] += g[i][d] * g[i][d];",
        "for (int i = 0; i < kBatch; ++i) sq[i] += g[i][d] * g[0][d];",
        "row-wise Adagrad's 8-row interleaved branch mixes rows",
    ),
    Mutant(
        "rowwise_adagrad_no_weight_decay",
        BWD,
        "for (int i = 0; i < n; ++i) add_weight_decay(A.wd, w[i], g[i], Ds[i]);",
        "for (int i = 0; i < n; ++i) add_weight_decay(0.0f, w[i], g[i], Ds[i]);",
        "row-wise Adagrad ignores weight decay",
    ),
    Mutant(
        "adam_no_bias_correction1",
        BWD,
        "static_cast<float>(A.lr / bc1);",
        "static_cast<float>(A.lr);",
        "Adam without the first moment's bias correction",
    ),
    Mutant(
        "adam_no_bias_correction2",
        BWD,
        "std::sqrt(vd) / bc2s + A.eps",
        "std::sqrt(vd) + A.eps",
        "Adam without the second moment's bias correction",
    ),
    Mutant(
        "adam_global_step",
        BWD,
        "*step += 1.0f;",
        "*step = 1.0f;",
        "Adam corrects every update as a first step (step count not kept per row)",
    ),
    Mutant(
        "adam_beta2_in_first_moment",
        BWD,
        "m[d] += omb1 * (g[d] - m[d]);",
        "m[d] += omb2 * (g[d] - m[d]);",
        "Adam's first moment decays with beta2",
    ),
    Mutant(
        "adam_eps_inside_sqrt",
        BWD,
        "std::sqrt(vd) / bc2s + A.eps",
        "std::sqrt(vd + A.eps) / bc2s",
        "Adam's eps inside the square root",
    ),
    Mutant(
        "rowwise_adam_sum_not_mean",
        BWD,
        "omb2 * (sum_squares(g, D) / static_cast<float>(D));",
        "omb2 * sum_squares(g, D);",
        "row-wise Adam's second moment takes the sum of g^2, not the mean",
    ),
    # -- duplicate merging, pooling and per-id weights -----------------------------------
    Mutant(
        "duplicates_last_wins",
        BWD,
        "for (int64_t d = 0; d < D; ++d) acc[d] += go[d];",
        "for (int64_t d = 0; d < D; ++d) acc[d] = go[d];",
        "a row's duplicate ids: the last one's gradient replaces the sum",
    ),
    Mutant(
        "radix_sort_drops_top_bit",
        BWD,
        "while ((int64_t(1) << bits) < total_rows) ++bits;",
        "while ((int64_t(1) << bits) < total_rows / 2) ++bits;",
        "the radix sort ignores the top bit of the row key: a row's ids are not contiguous",
    ),
    Mutant(
        "forward_mean_not_divided",
        TBE,
        "for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / mean_L;",
        "for (int64_t d = 0; d < D; ++d) o[d] = acc[d];",
        "mean pooling returns the sum (forward)",
    ),
    Mutant(
        "backward_mean_direct_not_divided",
        BWD,
        "for (int64_t d = 0; d < D; ++d) acc[d] += go[d] / L;",
        "for (int64_t d = 0; d < D; ++d) acc[d] += go[d];",
        "mean pooling's backward (direct reads) forgets to divide by the bag length",
    ),
    Mutant(
        "backward_mean_gather_not_divided",
        BWD,
        "for (int64_t d = 0; d < D; ++d) dst[d] = go[d] / L;",
        "for (int64_t d = 0; d < D; ++d) dst[d] = go[d];",
        "mean pooling's backward (gathered rows) forgets to divide by the bag length",
    ),
    Mutant(
        "forward_ignores_per_id_weights",
        TBE,
        "Codec::accum(table + id * bytes, D, S.psw ? S.psw[j] : 1.0f, acc, tmp);",
        "Codec::accum(table + id * bytes, D, 1.0f, acc, tmp);",
        "weighted bags pooled without their per-id weights",
    ),
    Mutant(
        "backward_row_update_ignores_per_id_weights",
        BWD,
        "for (int64_t d = 0; d < D; ++d) acc[d] += (go[d] / L) * pw;",
        "for (int64_t d = 0; d < D; ++d) acc[d] += (go[d] / L);",
        "weighted bags: the row update ignores the per-id weights",
    ),
    Mutant(
        "per_id_weight_gradient_doubled",
        BWD,
        "A.psw_grad[j] = dot;",
        "A.psw_grad[j] = 2.0f * dot;",
        "gradient of the per-id weights is twice too large",
    ),
    Mutant(
        "forward_bounds_off_by_one",
        TBE,
        "if (id < 0 || id >= S.rows) {\n      if (S.check) S.record_bad(id);\n"
        "      continue;\n    }\n    Codec::accum(",
        "if (id < 0 || id > S.rows) {\n      if (S.check) S.record_bad(id);\n"
        "      continue;\n    }\n    Codec::accum(",
        "the forward bounds check lets id == rows through",
    ),
    # -- the thread split -----------------------------------------------------------------
    Mutant(
        "radix_sort_unstable_across_chunks",
        BWD,
        "for (int64_t p = 0; p < parts; ++p) {\n        const int64_t c = hist",
        "for (int64_t p = parts - 1; p >= 0; --p) {\n        const int64_t c = hist",
        "the parallel radix sort places chunks in reverse: unstable with 2+ chunks",
    ),
    Mutant(
        "update_ranges_split_rows",
        BWD,
        "while (k > 0 && k < n && (keys[k] >> 32) == (keys[k - 1] >> 32)) ++k;",
        "while (false) ++k;",
        "thread ranges of the update may split one row's duplicates between threads",
    ),
    Mutant(
        "forward_accumulator_reset_per_chunk",
        TBE,
        "std::fill(acc, acc + D, 0.0f);\n  for (int64_t j = j0; j < j1; ++j) {\n"
        "    if (j + S.ahead",
        "if (j0 == 0) std::fill(acc, acc + D, 0.0f);\n  for (int64_t j = j0; j < j1; ++j) {\n"
        "    if (j + S.ahead",
        "the any-format forward clears its accumulator once (first bag), not per bag",
    ),
]


# The files most likely to fail first (pytest -x stops there), then every other kernel
# test file. Files, not the folder: given a folder, pytest collects in name order.
FIRST_TESTS = (
    "test_kernels_optim_matrix.py",
    "test_kernels_quant.py",
    "test_kernels_determinism.py",
)
DEFAULT_TESTS = [
    f"tests/unit/kernels/{name}"
    for name in sorted(
        (p.name for p in (ROOT / "tests/unit/kernels").glob("test_*.py")),
        key=lambda n: (FIRST_TESTS.index(n) if n in FIRST_TESTS else len(FIRST_TESTS), n),
    )
]


def _copy_tree(dst: Path) -> None:
    """The package, the tests and the pytest configuration, without build outputs.

    ``copy2`` keeps the sources' modification times, so that the kernel build of the
    unmutated copy stays up to date for the files a mutant does not touch.
    """
    if dst.exists():
        shutil.rmtree(dst)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", ".pytest_cache")
    shutil.copytree(ROOT / "tetrarec", dst / "tetrarec", ignore=ignore)
    shutil.copytree(ROOT / "tests", dst / "tests", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _apply(m: Mutant, tree: Path) -> None:
    path = tree / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutant {m.name}: {count} matches of its pattern in {m.file}, not 1")
    path.write_text(text.replace(m.old, m.new))


def _forget_mutated_objects(cache: Path) -> None:
    """Drop the kernel's object and module so that ninja rebuilds them.

    Every mutant edits tbe_cpu.cpp or the header it includes, and a restored source is
    older than the previous mutant's object.
    """
    for pattern in ("tbe_cpu.o", "*.so"):
        for path in cache.rglob(pattern):
            path.unlink()


class Sandbox:
    """A scratch copy of the tree with its own kernel build cache (``XDG_CACHE_HOME``).

    The copy always lives at the same path, so the kernel build directory and its
    ninja files stay valid from one mutant to the next and only ``tbe_cpu.cpp`` is
    recompiled per mutant.
    """

    def __init__(self, root: Path, tests: list[str], timeout: float) -> None:
        self.tree, self.cache = root / "tree", root / "cache"
        self.tests, self.timeout = tests, timeout
        self.env = dict(os.environ)
        self.env.update(
            XDG_CACHE_HOME=str(self.cache),  # never the user's kernel build directory
            TETRAREC_KERNELS="compiled",  # a failed build is an error, never a skip
            PYTHONDONTWRITEBYTECODE="1",
        )
        self.env.pop("PYTHONPATH", None)

    def _run(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        # cwd = the copy: `python -m ...` puts it first on sys.path, so the tests import
        # the mutated package, not the working tree's (an editable install's finder
        # comes after sys.path).
        # Its own process group: on a timeout the compiler or pytest workers it started
        # are ended with it, not left running.
        with subprocess.Popen(
            cmd, cwd=self.tree, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        ) as proc:  # fmt: skip
            try:
                out, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def build(self) -> subprocess.CompletedProcess[str]:
        """Build (or load) the copy's kernels and check that the copy is what runs."""
        code = (
            "import tetrarec, tetrarec.kernels as k; "
            f"assert tetrarec.__file__.startswith({str(self.tree)!r}), tetrarec.__file__; "
            "assert k.build_cpu_kernels()"
        )
        return self._run([sys.executable, "-c", code])

    def test(self) -> tuple[str, str]:
        """``(killed | survived | error, first failure or summary line)``."""
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *self.tests]
        try:
            run = self._run(cmd)
        except subprocess.TimeoutExpired:
            return "killed", "timeout"
        lines = run.stdout.strip().splitlines()
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        status = {0: "survived", 1: "killed"}.get(run.returncode, "error")
        return status, (failed or lines[-1:] or [""])[0]

    def baseline(self) -> None:
        """Build the unmutated copy and check that its tests pass."""
        _copy_tree(self.tree)
        build = self.build()
        if build.returncode != 0:
            raise SystemExit(f"the unmutated kernels do not build:\n{build.stderr[-3000:]}")
        status, detail = self.test()
        if status != "survived":
            raise SystemExit(f"the unmutated tree fails its tests ({status}): {detail}")

    def mutant(self, m: Mutant) -> dict[str, object]:
        """Build and test one mutant; its result as a JSON-ready dict."""
        start = time.perf_counter()
        _copy_tree(self.tree)
        _apply(m, self.tree)
        _forget_mutated_objects(self.cache)
        try:
            build = self.build()
        except subprocess.TimeoutExpired:
            return {"name": m.name, "status": "build-failed", "detail": "build timed out"}
        build_s = round(time.perf_counter() - start, 1)
        if build.returncode != 0:
            tail = build.stderr.strip().splitlines()[-1:] or [""]
            return {"name": m.name, "status": "build-failed", "detail": tail[0], "build_s": build_s}
        status, detail = self.test()
        test_s = round(time.perf_counter() - start - build_s, 1)
        return {"name": m.name, "status": status, "detail": detail, "build_s": build_s,
                "test_s": test_s}  # fmt: skip


def main() -> int:
    """Run the chosen mutants; exit status 0 when the score reaches the goal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", default=None, help="run only these mutants")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest paths")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per step")
    parser.add_argument("--goal", type=float, default=0.9, help="required kill ratio")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not check the unmutated tree first"
    )
    args = parser.parse_args()
    names = {m.name for m in MUTANTS}
    assert len(names) == len(MUTANTS), "mutant names must be unique"
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:45s} {m.what}")
        return 0
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        parser.error(f"unknown mutants {unknown}; see --list")
    by_name = {m.name: m for m in MUTANTS}
    chosen = MUTANTS if args.only is None else [by_name[n] for n in args.only]  # in that order
    for m in chosen:  # every pattern matches before anything is built
        if (ROOT / m.file).read_text().count(m.old) != 1:
            raise SystemExit(f"mutant {m.name}: its pattern does not match {m.file} once")
    root = Path(tempfile.mkdtemp(prefix="tetrarec-cpp-mutants-"))
    sandbox = Sandbox(root, args.tests, args.timeout)
    start = time.perf_counter()
    results = []
    try:
        if not args.skip_baseline:
            sandbox.baseline()
            print(f"baseline: builds and passes ({time.perf_counter() - start:.0f} s)", flush=True)
        for i, m in enumerate(chosen, 1):
            r = sandbox.mutant(m)
            r["what"] = m.what
            results.append(r)
            secs = float(r.get("build_s", 0)) + float(r.get("test_s", 0))
            print(
                f"[{i}/{len(chosen)}] {m.name:42s} {r['status']:9s} {secs:4.0f} s  {r['detail']}",
                flush=True,
            )
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    valid = [r for r in results if r["status"] in ("killed", "survived")]
    killed = sum(r["status"] == "killed" for r in valid)
    score = killed / len(valid) if valid else 0.0
    wall = time.perf_counter() - start
    print(f"\nC++ mutants: {killed}/{len(valid)} killed, score {score:.0%}, wall {wall:.0f} s")
    for r in results:
        if r["status"] != "killed":
            print(f"  {r['status']}: {r['name']} ({r['what']})")
    if args.json:
        args.json.write_text(
            json.dumps({"score": score, "wall_s": wall, "mutants": results}, indent=2)
        )
    return 0 if score >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
