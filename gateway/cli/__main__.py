"""`python -m gateway.cli`: the `switchboard` command."""

import sys

from gateway.cli import main

sys.exit(main())
