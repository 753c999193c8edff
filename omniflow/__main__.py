"""``python -m omniflow ...`` is the ``omniflow`` command."""

import sys

from omniflow.cli import main

sys.exit(main())
