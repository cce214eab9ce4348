"""Re-check every mutant of one file against some tests, in one process.

mutmut's trampolines read ``MUTANT_UNDER_TEST`` at each call, so one process can run
the tests once per mutant with the variable set in turn (``pytest.main``, about 1 s a
mutant instead of a fresh interpreter each). Run it in ``mutants/`` with the tests
copied there (``mutation/README.md``, kernels numerics). mutmut's own results do not
record these verdicts.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import os
import sys

import pytest


def main() -> int:
    """Print ``<mutant> killed|survived`` for each mutant in the ``.meta`` file given.

    Returns:
        0, or 1 when the tests fail on the unmutated code (nothing is re-checked then).
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("meta", help="mutants/<file>.py.meta of the file to re-check")
    parser.add_argument("tests", nargs="+", help="test files (in mutants/)")
    parser.add_argument("-k", default="", help="pytest -k expression")
    parser.add_argument(
        "--names",
        nargs="+",
        default=["*"],
        help="only the mutants whose names match one of these globs (default: all)",
    )
    opts = parser.parse_args()
    args = ["-x", "-q", "-p", "no:cacheprovider", *opts.tests, "-k", opts.k]
    os.environ["MUTANT_UNDER_TEST"] = "none"
    with contextlib.redirect_stdout(io.StringIO()):
        if pytest.main(args) != 0:
            print("the tests fail on the unmutated code", file=sys.stderr)
            return 1
    with open(opts.meta) as f:
        names = [
            name
            for name in json.load(f)["exit_code_by_key"]
            if any(fnmatch.fnmatchcase(name, glob) for glob in opts.names)
        ]
    for name in names:
        os.environ["MUTANT_UNDER_TEST"] = name
        with contextlib.redirect_stdout(io.StringIO()):
            rc = pytest.main(args)
        print(name, "survived" if rc == 0 else "killed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
