"""What a ``python -m`` run sees of itself, for tests/process/test_zygote.py: one JSON line, then the exit the
first argument asks for (a code, ``kill`` for SIGKILL, ``hang``, ``raise``)."""

import json
import multiprocessing.spawn
import os
import signal
import sys
import tempfile
import time

if __name__ == "__main__":
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "sid": os.getsid(0), "pid": os.getpid(),
        "ppid": os.getppid(), "env": os.environ.get("AS_MAIN"), "main_spec": sys.modules["__main__"].__spec__.name,
        "spawn_main": multiprocessing.spawn.get_preparation_data("x").get("init_main_from_name"),
        "tmp": tempfile.gettempdir(), "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }), flush=True)
    print("to stderr\r\nline", file=sys.stderr)
    how = sys.argv[1]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "hang":
        time.sleep(600)
    elif how == "raise":
        raise RuntimeError("a bug")
    sys.exit(int(how))
