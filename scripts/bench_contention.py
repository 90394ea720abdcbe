"""Throughput alone vs next to a busy process, per worker thread setting (evenflow/bench/contention.py).

    python scripts/bench_contention.py --model /work/models/smollm2-f32 [--pin 1] [--threads auto,1]
"""

import sys

from evenflow.bench.contention import main

if __name__ == "__main__":
    sys.exit(main())
