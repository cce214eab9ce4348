"""``python -m tetrarec``: the same as the ``tetrarec`` command."""

from tetrarec.cli import main

raise SystemExit(main())
