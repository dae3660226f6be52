"""``python -m cli.migrate_config [--check] FILE ...``: rewrite a config written for the flat ``GRPOModule``
arguments into the typed groups (docs/interfaces.md, "Migrating a config"). The command's logic is in
`cli.flat_flags`, with the rest of what is left of the flat arguments; this module is its entry point."""

from __future__ import annotations

import sys

from cli.flat_flags import main

if __name__ == "__main__":
    sys.exit(main())
