"""Live widgets for the lectures: sliders over a plain plotting function.

Each widget is a thin ipywidgets layer over a plain function that draws a static matplotlib
figure (``plot_*``), so the figure is testable without a browser and serves as the fallback
where widgets do not render (GitHub, a static export). ipywidgets is imported only when a
widget is built: ``import parlab.widgets.collectives`` works without it.
"""
