"""``python -m dmoe.monitor``: the ``dmoe-monitor`` program (:mod:`dmoe.cli.monitor`)."""
import sys

from dmoe.cli.monitor import main

if __name__ == "__main__":
    sys.exit(main())
