"""`python -m master JOB.yaml` runs a job's master (same as `dlrover master`)."""

import sys

from master.cli.main import main

sys.exit(main(["master", *sys.argv[1:]]))
