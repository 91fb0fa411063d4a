"""`python -m master.cli`: the `dlrover` command."""

import sys

from master.cli.main import main

sys.exit(main())
