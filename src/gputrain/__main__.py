import sys

from gputrain.cli import main

sys.exit(main())
