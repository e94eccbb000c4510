"""`python tools/compare.py ARGS` is `graph-fsdp compare ARGS` (see `graph-fsdp compare --help`)."""

import sys

from graph_fsdp.cli.main import main

sys.exit(main(["compare", *sys.argv[1:]]))
