#!/usr/bin/env python3
"""Where a served worker's time went, by what its steps carried.

Record while serving (the worker writes PREFIX.config.json, PREFIX.frames, PREFIX.steps.jsonl):

    EVENFLOW_STEP_RECORD=/tmp/run1 evenflow serve --model M ...

then:

    python scripts/account_steps.py /tmp/run1 [--long-tokens 1000]

prints, per kind of step (decodes only; a long prompt's token chunk or layer group; short prompts beside
it), the steps, their wall time, and the decode and prompt tokens they carried.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evenflow.bench.step_account import account, format_account


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", type=Path, help="the EVENFLOW_STEP_RECORD prefix of the recording")
    ap.add_argument("--long-tokens", type=int, default=1000, help="a prompt longer than this is a long one")
    args = ap.parse_args()
    print(format_account(account(args.prefix, args.long_tokens)))


if __name__ == "__main__":
    main()
