"""Live widgets for the lectures: sliders over a plain plotting function.

Each widget is a thin ipywidgets layer over a plain function that draws a static matplotlib
figure (``plot_*``), so the figure is testable without a browser. In a notebook each widget
function also displays a static picture of its first state as an output of its own: that is
what a saved notebook shows once reopened (the live widget needs the kernel that made it) and
what GitHub shows. ipywidgets is imported only when a widget is built:
``import parlab.widgets.collectives`` works without it, and without it the widget functions
return their static figure.

What every widget shares (the picture, labels that fit, the feedback line where callbacks
report errors and progress, replacing a closed cluster) lives in ``parlab.widgets._common``.
"""
