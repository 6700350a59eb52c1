"""``python -m blitzllm.cli``: the ``blitz`` command."""
import sys

from . import main

sys.exit(main())
