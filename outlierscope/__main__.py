import sys

from outlierscope.cli import main

sys.exit(main())
