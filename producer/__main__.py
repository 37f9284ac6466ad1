"""`python -m producer submit | tail | stats`: the producer's commands without torch."""

import sys

from producer.cli import main

sys.exit(main())
