"""`python -m qvl.tiny`: writes the tiny offline Qwen3-VL, in qvl/engine/tiny.py."""
from qvl.engine.tiny import main

if __name__ == "__main__":
    main()
