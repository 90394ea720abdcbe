"""``python -m evenflow.frontend serve ...`` is the ``evenflow`` command."""

import sys

from .cli import main

sys.exit(main())
