"""On PYTHONPATH, makes this interpreter act as if diffusers were not installed (tests/process/test_cli_errors.py)."""

import sys

sys.modules["diffusers"] = None
