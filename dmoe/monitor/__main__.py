"""``python -m dmoe.monitor``: the ``dmoe-monitor`` program (:mod:`dmoe.cli.monitor`)."""
from dmoe.cli.monitor import main

if __name__ == "__main__":
    main()
