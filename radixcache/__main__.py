import sys

from radixcache.cli import main

sys.exit(main())
