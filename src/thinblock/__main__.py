"""`python -m thinblock` runs the command line."""

import sys

from thinblock.frontends.cli.main import main

sys.exit(main())
