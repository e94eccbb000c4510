"""`python tools/memory_breakdown.py ENGINE ARGS` is `graph-fsdp profile --memory ENGINE ARGS`.

ENGINE is graph_fsdp or fsdp2; see `graph-fsdp profile --help` and graph_fsdp/bench/memory.py.
"""

import sys

from graph_fsdp.cli.main import main

if __name__ == "__main__":  # the ranks are spawned: they re-import this file
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python tools/memory_breakdown.py {graph_fsdp,fsdp2} [profile args]")
    sys.exit(main(["profile", "--memory", *sys.argv[1:]]))
