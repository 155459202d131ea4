"""The trainer: ``python clients/train.py --experts remote --initial-peers HOST:PORT ...``.

The same program is installed as ``dmoe-train`` (:mod:`dmoe.cli.train`; the loop is :mod:`dmoe.trainer`).
"""
from dmoe.cli.train import main

if __name__ == "__main__":
    main()
