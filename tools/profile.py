"""`python tools/profile.py ARGS` is `graph-fsdp profile ARGS` (see `graph-fsdp profile --help`)."""

import sys

from graph_fsdp.cli.main import main

sys.exit(main(["profile", *sys.argv[1:]]))
