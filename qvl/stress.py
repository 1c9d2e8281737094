"""`python -m qvl.stress`: the load, soak and fault tests, in qvl/tools/stress.py."""
import sys

from qvl.tools.stress import main

if __name__ == "__main__":
    sys.exit(main())
