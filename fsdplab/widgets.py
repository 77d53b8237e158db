"""ipywidgets dashboards: sliders and dropdowns that redraw a matplotlib figure.

`Dashboard` is the one mechanism every lesson uses. It works without a browser: `dashboard.set(...)`
changes controls from code (tests and papermill runs do this) and `dashboard.figure` is the figure drawn
for the current values, so what a reader sees can be checked.
"""

from __future__ import annotations

import ipywidgets as W
import matplotlib.pyplot as plt


class Dashboard:
    """`controls`: name -> ipywidgets control; `draw(fig, **values)` draws into a cleared figure."""

    def __init__(self, controls: dict, draw, title: str = "", figsize=(8, 4)):
        self.controls, self.draw, self.title = controls, draw, title
        self.output = W.Output()
        self.figure = plt.figure(figsize=figsize)
        # Closed figures stay drawable but are no longer shown by the inline backend at the end of the
        # cell: the dashboard shows its figure once, inside its own output area.
        plt.close(self.figure)
        self.widget = W.VBox([W.HTML(f"<b>{title}</b>") if title else W.HTML(""),
                              W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                              self.output])
        for control in controls.values():
            control.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def refresh(self):
        self.figure.clear()
        self.result = self.draw(self.figure, **self.values)
        with self.output:
            self.output.clear_output(wait=True)
            from IPython.display import display

            display(self.figure)
        return self.result

    def set(self, **values):
        """Change controls as a reader would; the figure redraws once per change."""
        for name, value in values.items():
            if name not in self.controls:
                raise ValueError(f"no control {name!r}; this dashboard has {list(self.controls)}.")
            self.controls[name].value = value
        return self.result

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
