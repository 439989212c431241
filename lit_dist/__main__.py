"""The ``lit-dist`` command (and ``python -m lit_dist``): its first code, before the CLI's import.

Importing lit_dist.cli.app imports Lightning, torch and torch._dynamo: about 4 s before anything else can run. Right
after that import, while nothing else runs, this process forks what will start its local ranks
(lit_dist/runtime/warm_ranks.py: they then need no import of their own) and, when the command will start loader
workers through a fork server (lit_dist/reading/workers.py), that server, sharing the import too; where the server
cannot be a fork, it is started before the import, so that its own import of the same modules runs beside this one.
This module imports nothing heavy: loader workers started from a new interpreter re-run it (as their
``__mp_main__``).
"""

import sys


def main() -> None:
    from lit_dist.reading import workers
    from lit_dist.runtime.extras import bitsandbytes_without_hub_kernels
    from lit_dist.runtime.processes import quiet_resource_tracker

    quiet_resource_tracker()  # before any helper process starts
    bitsandbytes_without_hub_kernels()  # before the config names its optimizer
    argv = sys.argv[1:]
    start = workers.server_for_command(argv)
    early = start is not None and not workers.can_fork_server()
    if early:  # a new interpreter: its import beside ours (quickstart 10.8 -> 7.1 s)
        workers.start_early(start)
    import lit_dist.cli.app  # noqa: F401 - the import every process of the run shares from here on
    from lit_dist.runtime import warm_ranks

    if not early:  # a zygote would inherit the early server's handle, which its ranks must not share
        warm_ranks.prepare(argv, after_imports)
    after_imports(argv)


def after_imports(argv: list[str]) -> None:
    """What the command runs once lit-dist is imported: in the launching process, and in each local rank its
    zygote forks (which starts from here)."""
    from lit_dist.cli.app import main as cli_main
    from lit_dist.reading import workers

    if workers.server_for_command(argv) is not None and workers.can_fork_server():
        workers.fork_server_here()
    cli_main()


if __name__ == "__main__":
    main()
