"""Holds the sitecustomize that fastfeed run puts on PYTHONPATH (see fastfeed.run)."""
