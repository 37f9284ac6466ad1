"""`python -m qworker_client`: the `qworker` command, without needing it on PATH."""

import sys

from qworker_client.cli import main

sys.exit(main())
