"""``python -m benchmarks``: run every benchmark and write the report."""

import sys

from benchmarks.report import main

sys.exit(main())
