"""``python -m dmoe.dht``: the ``dmoe-dht`` program (:mod:`dmoe.cli.dht`)."""
import sys

from dmoe.cli.dht import main

if __name__ == "__main__":
    sys.exit(main())
