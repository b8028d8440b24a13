"""matplotlib's Figure and Agg canvas, imported only when a plot is drawn: matplotlib is the optional [plot] extra.

Plots never go through ``pyplot``: fastfeed may draw inside a notebook whose pyplot state is the user's.
"""

from __future__ import annotations


def agg(needs: str):
    """``(Figure, FigureCanvasAgg)``; without matplotlib, ImportError with ``needs`` (which names the extra)."""
    try:
        # the package first: one blocked in sys.modules fails here even if its submodules were imported before
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(needs) from e
    return Figure, FigureCanvasAgg
