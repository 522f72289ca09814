"""`python -m dsv4kv ...`: the command line (`dsv4kv.tools.cli`)."""

from .tools.cli import main

raise SystemExit(main())
