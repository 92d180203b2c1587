"""Storage helpers: local paths and gs:// URLs behind one interface (see paths.py)."""
