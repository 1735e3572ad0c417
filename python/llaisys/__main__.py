"""`python -m llaisys ...` runs the command line (see llaisys.cli)."""
from .cli import main

raise SystemExit(main())
