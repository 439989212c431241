"""Imported by a rank's fork server (``set_forkserver_preload`` in lit_dist/reading/workers.py), where the import
itself asks the kernel to end the server when the rank that started it ends; the workers forked from the
server do the same towards it. The only lit-dist module whose import acts: a fork server runs no other code of
ours before it forks, and it acts only in the process the rank marked by ``SERVER_ENV`` as its server."""

import os

from lit_dist.runtime.processes import die_with_parent

SERVER_ENV = "LIT_DIST_FORK_SERVER_OF"  # the pid of the rank starting a fork server, in the server's environment

if os.environ.get(SERVER_ENV) == str(os.getppid()):
    die_with_parent(os.getppid())
