"""`python tools/bench.py ARGS` is `graph-fsdp bench ARGS` (see `graph-fsdp bench --help`)."""

import sys

from graph_fsdp.cli.main import main

sys.exit(main(["bench", *sys.argv[1:]]))
