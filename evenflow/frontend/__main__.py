"""``python -m evenflow.frontend serve ...`` is the ``evenflow`` command."""

import sys

from evenflow.frontend.cli import main

sys.exit(main())
