"""Scripts for building, checking and running the project (run them as `python tools/NAME.py`)."""
