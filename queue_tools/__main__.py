"""`python -m queue_tools ...` is the same as the `queue_tools` console script."""

import sys

from queue_tools.cli import main

sys.exit(main())
