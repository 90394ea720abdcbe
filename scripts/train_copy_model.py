#!/usr/bin/env python3
"""Train the tiny copy model the speculation benchmark uses (see evenflow/bench/copy_model.py)."""

from evenflow.bench.copy_model import main

if __name__ == "__main__":
    main()
