"""`python -m fsdpctl`: the same as the `fsdpctl` command."""

import sys

from fsdpctl.cli import main

sys.exit(main())
