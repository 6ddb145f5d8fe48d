"""`python -m benchmarks [--quick]`: see `benchmarks/__init__.py`."""

import sys

from benchmarks.runner import main

sys.exit(main(sys.argv[1:]))
