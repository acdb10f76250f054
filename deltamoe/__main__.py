import sys

from deltamoe.cli import main

sys.exit(main())
