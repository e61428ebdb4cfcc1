"""`python -m serving.cli`: the `inferline` command."""
from serving.cli.main import main

raise SystemExit(main())
