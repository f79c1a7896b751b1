"""``python -m subspec``: the same command line as the ``subspec`` console script."""
import sys

from .cli import main

sys.exit(main())
