"""`python -m verispec.cli ...`: the `verispec` command."""

import sys

from . import main

sys.exit(main())
