"""Re-check the mutants of one file against some tests, in one process.

mutmut's trampolines read ``MUTANT_UNDER_TEST`` at each call, so one process can run
the tests once per mutant with the variable set in turn (``pytest.main``, about 1 s a
mutant instead of a fresh interpreter each). Run it in ``mutants/`` with the tests
copied there (``mutation/README.md``, kernels numerics). mutmut's own results do not
record these verdicts.

With ``--stats mutmut-stats.json`` each mutant also runs the tests that mutmut's stats
run associates with its function (the tests ``mutmut run`` would run for it), after the
test files given: mutmut's verdict without its per-mutant interpreter start (a minute a
mutant on a loaded 2-core machine). Unlike mutmut, the mutants share one process.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import os
import signal
import sys
import time
from types import FrameType

import pytest


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # pytest.main stops and returns ExitCode.INTERRUPTED


def main() -> int:
    """Print ``<mutant> killed|survived|timeout <seconds>`` for the mutants of a ``.meta``.

    Returns:
        0, or 1 when the tests fail on the unmutated code (nothing is re-checked then).
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("meta", help="mutants/<file>.py.meta of the file to re-check")
    parser.add_argument("tests", nargs="*", help="test files or node ids (in mutants/)")
    parser.add_argument("-k", default="", help="pytest -k expression")
    parser.add_argument(
        "--stats", help="mutmut-stats.json: also run the tests mutmut associates with each"
    )
    parser.add_argument(
        "--only",
        "--names",
        nargs="*",
        default=["*"],
        help="fnmatch globs of the mutant names to run (default: all)",
    )
    parser.add_argument(
        "--timeout", type=int, default=300, help="seconds a mutant may run (then: timeout)"
    )
    opts = parser.parse_args()
    with open(opts.meta) as f:
        names = [
            n
            for n in json.load(f)["exit_code_by_key"]
            if any(fnmatch.fnmatchcase(n, g) for g in opts.only)
        ]
    by_function: dict[str, list[str]] = {}
    if opts.stats:
        with open(opts.stats) as f:
            by_function = json.load(f)["tests_by_mangled_function_name"]

    def tests_of(name: str) -> list[str]:
        extra = sorted(by_function.get(name.rsplit("__mutmut_", 1)[0], []))
        return list(opts.tests) + [t for t in extra if t not in opts.tests]

    def run(name: str, tests: list[str]) -> int:
        os.environ["MUTANT_UNDER_TEST"] = name
        args = ["-x", "-q", "-p", "no:cacheprovider", *tests, "-k", opts.k]
        signal.alarm(opts.timeout)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                return int(pytest.main(args))
        finally:
            signal.alarm(0)

    signal.signal(signal.SIGALRM, _interrupt)
    union = sorted({t for n in names for t in tests_of(n)})
    if run("none", union) != 0:
        print("the tests fail on the unmutated code", file=sys.stderr)
        return 1
    for name in names:
        start = time.monotonic()
        rc = run(name, tests_of(name))
        verdict = {0: "survived", 2: "timeout"}.get(rc, "killed")
        print(name, verdict, f"{time.monotonic() - start:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
