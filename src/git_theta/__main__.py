"""``python -m git_theta``: what every command line git-theta writes for git runs."""

import gc
import sys

# A command lives for one git call, and what it allocates is mostly acyclic (its modules'
# functions and classes, manifest records): a young-generation collection every 700
# allocations cost ~2.5 ms of the imports alone. Cycles are still collected, less often.
gc.set_threshold(20_000)

from git_theta.interpreter import drop_untrusted_paths  # noqa: E402

# Before anything else of ours is imported: nothing may come from the work tree.
_loaded = drop_untrusted_paths()
if _loaded:
    sys.stderr.write(
        f"git-theta: error: Python imported {', '.join(_loaded)} from the working directory "
        "(PYTHONPATH has an empty or relative entry): fix PYTHONPATH, then run "
        "`git theta install` again\n"
    )
    sys.exit(1)
if sys.argv[1:2] == ["filter-server"]:  # the warm filter server (filter_client starts it)
    from git_theta.forkserver import main

    sys.exit(main(sys.argv[2:]))

from git_theta.commands.cli import entry  # noqa: E402

entry()
