"""`python -m trainer.checkpoint`."""

import sys

from trainer.checkpoint.cli import main

sys.exit(main())
