"""The main job, ``make demo``: ``python -m clients.swarm_demo [dmoe-train flags]`` starts a whole local swarm
(a DHT node and expert servers) and trains the gated transformer LM against it (:mod:`dmoe.cli.demo`; installed
as ``dmoe-demo`` too)."""
import sys

from dmoe.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
