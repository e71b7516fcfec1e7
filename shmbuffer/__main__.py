"""``python -m shmbuffer``: the ``shmbuffer`` command (``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
