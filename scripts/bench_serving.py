#!/usr/bin/env python3
"""Benchmark an OpenAI-compatible server under a workload (see evenflow/bench/serving.py)."""

import sys

from evenflow.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
