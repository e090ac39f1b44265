"""`python -m classify_client`: the `classify` command (classify_client.cli)."""

import sys

from classify_client.cli import main

sys.exit(main())
