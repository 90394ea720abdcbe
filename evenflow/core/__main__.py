"""``python -m evenflow.core`` is the ``engine-core`` console script."""

import sys

from evenflow.core.cli import main

sys.exit(main())
