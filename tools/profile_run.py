"""`python tools/profile_run.py ARGS` is `graph-fsdp profile ARGS` (named so that it does not shadow the stdlib `profile` module)."""

import sys

from graph_fsdp.cli.main import main

sys.exit(main(["profile", *sys.argv[1:]]))
