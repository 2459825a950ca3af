"""`python -m thinblock` runs the command line."""

import sys

from thinblock.cli.main import main

sys.exit(main())
