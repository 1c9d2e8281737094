__version__ = "0.1.0"  # what `python app.py --version` prints
