"""ipywidgets dashboards: sliders and dropdowns that redraw a matplotlib figure.

`Dashboard` is the one mechanism every lesson uses. It works without a browser: `dashboard.set(...)`
changes controls from code (tests and papermill runs do this) and `dashboard.figure` is the figure drawn
for the current values, so what a reader sees can be checked.
"""

from __future__ import annotations

import html
import io

import ipywidgets as W
import matplotlib.pyplot as plt


class Dashboard:
    """`controls`: name -> ipywidgets control; `draw(fig, **values)` draws into a cleared figure.

    The figure reaches the page as PNG bytes in an `ipywidgets.Image`, not through an `Output` widget:
    an Output widget captures messages from whichever cell runs next, which papermill's client mimics
    imperfectly (executions were seen to stall); an Image is plain widget state.
    """

    def __init__(self, controls: dict, draw, title: str = "", figsize=(8, 4), dpi: int = 90):
        self.controls, self.draw, self.title, self.dpi = controls, draw, title, dpi
        self.figure = plt.figure(figsize=figsize)
        # Closed figures stay drawable but are no longer shown by the inline backend at the end of the
        # cell: the dashboard shows its figure once, in its own image.
        plt.close(self.figure)
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.status = W.HTML()
        self.widget = W.VBox([W.HTML(f"<b>{title}</b>") if title else W.HTML(""),
                              W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                              self.image, self.status])
        for control in controls.values():
            control.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def refresh(self):
        self.figure.clear()
        self.result = self.draw(self.figure, **self.values)
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=self.dpi, bbox_inches="tight")
        self.image.value = buffer.getvalue()
        return self.result

    def say(self, text: str) -> None:
        """Show `text` (monospace) under the figure, replacing what was there."""
        self.status.value = f"<pre style='font-size: 11px'>{html.escape(text)}</pre>" if text else ""

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
