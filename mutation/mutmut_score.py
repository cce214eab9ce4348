"""Print mutmut's score and every mutant it did not kill (after ``mutmut run``).

Reads ``mutmut results --all true`` (one ``name: status`` line per mutant). The score is
killed (timeouts count as killed) over the mutants that were checked: survivors, "no
tests" (no selected test reaches the mutated function), suspicious ones and segfaults
count against it; "not checked" mutants (outside the names given to ``mutmut run``) and
skipped ones are left out. ``--sharded`` takes the verdicts of
``mutation/sharded_state_mutants.py`` (``--json``): the ``train/state.py`` mutants that only
sharded ranks reach, which mutmut reports as "no tests" (or survived); the ones it
killed count as killed. Exit status 0 when the score reaches ``--goal``.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

KILLED = ("killed", "timeout", "killed (sharded check)")
NOT_COUNTED = ("not checked", "skipped", "check was interrupted by user")


def main() -> int:
    """Print the score and the mutants not killed; exit 0 when the score reaches the goal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--goal", type=float, default=0.9, help="required kill ratio")
    parser.add_argument("--mutmut", default="mutmut", help="the mutmut executable")
    parser.add_argument("--sharded", help="verdicts of mutation/sharded_state_mutants.py")
    args = parser.parse_args()
    out = subprocess.run(
        [args.mutmut, "results", "--all", "true"], check=True, capture_output=True, text=True
    ).stdout
    status = {}
    for line in out.splitlines():
        name, sep, state = line.strip().rpartition(": ")
        if sep:
            status[name] = state
    if args.sharded:
        for short, (verdict, _) in json.loads(Path(args.sharded).read_text()).items():
            name = f"tetrarec.train.state.{short}"
            if verdict == "killed" and status.get(name) in ("no tests", "survived"):
                status[name] = "killed (sharded check)"
    counts = collections.Counter(status.values())
    checked = {n: s for n, s in status.items() if s not in NOT_COUNTED}
    killed = sum(s in KILLED for s in checked.values())
    score = killed / len(checked) if checked else 0.0
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"Python mutants (mutmut): {killed}/{len(checked)} killed, score {score:.1%} ({summary})")
    for name, state in sorted(checked.items()):
        if state not in KILLED:
            print(f"  {state}: {name}")
    return 0 if score >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
