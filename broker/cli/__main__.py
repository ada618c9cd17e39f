"""`python -m broker.cli`: the `gpubroker` command line."""

import sys

from broker.cli.main import main

sys.exit(main())
