"""The ``lit-dist`` command (and ``python -m lit_dist``): its first code, before the CLI's import.

Importing lit_dist.cli imports Lightning, torch and torch._dynamo: about 4 s before anything else can run. A
loader workers' fork server imports the same modules; started here it does so beside that import rather than
after it. This module imports nothing heavy: loader workers re-run it (as their ``__mp_main__``).
"""

import sys


def main() -> None:
    from lit_dist.reading.workers import start_for_command

    start_for_command(sys.argv[1:])
    from lit_dist.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
