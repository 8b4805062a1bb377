import sys

from elixir.cli import main

sys.exit(main())
