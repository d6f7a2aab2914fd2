"""``python -m kvcanary``: the same command line as ``kvcanary``."""

import sys

from kvcanary.cli import main

sys.exit(main())
