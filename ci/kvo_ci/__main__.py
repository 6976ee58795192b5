"""`python3 -B ci/kvo_ci SUB ARGS...`: runs subcommand SUB (see __init__.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvo_ci.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
