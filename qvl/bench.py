"""`python -m qvl.bench`: the benchmark, in qvl/tools/bench.py."""
from qvl.tools.bench import main

if __name__ == "__main__":
    main()
