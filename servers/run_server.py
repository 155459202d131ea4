"""The expert server a volunteer launches: ``python servers/run_server.py --experts 'ffn0.[0:4].[0:4]' ...``.

The same program is installed as ``dmoe-server`` (:mod:`dmoe.cli.server`); ``--help`` lists every flag.
"""
from dmoe.cli.server import main

if __name__ == "__main__":
    main()
