"""``python -m graph_fsdp``: the ``graph-fsdp`` command line (graph_fsdp/cli/main.py)."""

import sys

from graph_fsdp.cli.main import main

sys.exit(main())
