"""The ``lit-dist`` command (and ``python -m lit_dist``): its first code, before the CLI's import.

Importing lit_dist.cli.app imports Lightning, torch and torch._dynamo: about 4 s before anything else can run. When
the command will start loader workers through a fork server (lit_dist/reading/workers.py), that server is made a
fork of this process right after the import, sharing it; where it cannot be, it is started before the import,
so that its own import of the same modules runs beside this one. This module imports nothing heavy: loader
workers started from a new interpreter re-run it (as their ``__mp_main__``).
"""

import sys


def main() -> None:
    from lit_dist.reading import workers
    from lit_dist.runtime.processes import quiet_resource_tracker

    quiet_resource_tracker()  # before any helper process starts

    start = workers.server_for_command(sys.argv[1:])
    forked = start is not None and workers.can_fork_server()
    if start is not None and not forked:  # a new interpreter: its import beside ours (quickstart 10.8 -> 7.1 s)
        workers.start_early(start)
    from lit_dist.cli.app import main as cli_main

    if forked:
        workers.fork_server_here()
    cli_main()


if __name__ == "__main__":
    main()
