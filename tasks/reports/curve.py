"""A run's training curve, drawn with matplotlib: the training series (SFT's loss, GRPO's mean reward, DPO's reward
accuracy) and, when the run evaluated, the held-out series (`eval_loss`, `eval_reward`, `eval_reward_accuracies`),
with labelled axes and a legend.

    .venv/bin/python -c "from tasks.reports.curve import curve_png; from loraflow_worker.contract import TrainMetrics; \
open('/tmp/c.png', 'wb').write(curve_png(TrainMetrics(steps=2, losses=[(1, 2.0), (2, 1.0)], \
eval_loss=[(0, 2.2), (2, 1.3)], first_loss=2.0, final_loss=1.0, tokens=0, wall_seconds=1, device='cpu'), 'sft'))"

Drawn on a bare `Figure` with the Agg canvas, not through pyplot: no global figure state and no GUI backend in
a flow's process, which may run many flows at once. matplotlib is imported when the first curve is drawn, not when
a flow starts (it is about half a second of a run's start otherwise); `load_in_background` imports it while a run
waits for its job, and `draw_meanwhile` draws a finished job's curve while its endpoint's slot is given back and its
results are read, so that the report (`drawn_curve`) finds it drawn.
"""

from __future__ import annotations

import importlib
import io
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from loraflow_worker.contract import TrainMetrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_MATPLOTLIB = ("matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.ticker")
_loading: threading.Thread | None = None
_loading_lock = threading.Lock()
_drawing: tuple[str, Future[bytes | None]] | None = None
"""The curve `draw_meanwhile` is drawing: what it is of (`_curve_key`) and the PNG to come. One at a time: a flow
draws the curve of its last attempt only."""

SIZE_INCHES = (6.4, 3.2)
DPI = 100
"""640 × 320 pixels: wide enough to read in the summary's column."""
BACKGROUND = (255, 255, 255)
TRAIN_COLOR = (31, 119, 180)
"""The training series' colour (matplotlib's `tab:blue`), as RGB so that a screenshot can be searched for it."""
EVAL_COLOR = (255, 127, 14)
"""The held-out series' colour (matplotlib's `tab:orange`)."""


def curve_measure(algorithm: str) -> str:
    """What an algorithm's curve shows: `loss` (SFT), `mean reward` (GRPO), `reward accuracy` (DPO: the share of pairs
    whose chosen answer the adapter prefers, what preference tuning is judged by)."""
    return {"grpo": "mean reward", "dpo": "reward accuracy"}.get(algorithm, "loss")


def curve_figure(metrics: TrainMetrics, algorithm: str) -> Figure | None:
    """The run's curve: x is the optimizer step; y `curve_measure(algorithm)` in training, beside the same measure
    on the held-out examples when the run evaluated. None when neither series has two points."""
    measure = curve_measure(algorithm)
    train, held_out = {"mean reward": (metrics.rewards, metrics.eval_reward),
                       "reward accuracy": (metrics.reward_accuracies, metrics.eval_reward_accuracies),
                       "loss": (metrics.losses, metrics.eval_loss)}[measure]
    if len(train) < 2 and len(held_out) < 2:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained", facecolor=_rgb(BACKGROUND))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if train:
        axes.plot(*zip(*train), color=_rgb(TRAIN_COLOR), linewidth=2, label=f"training {measure}")
    if held_out:
        # Few points (the start, every N steps, the end): markers show where evaluation happened.
        axes.plot(*zip(*held_out), color=_rgb(EVAL_COLOR), linewidth=2, marker="o", markersize=4,
                  label=f"eval {measure} (held-out)")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes.set_ylabel(measure)
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def curve_png(metrics: TrainMetrics, algorithm: str) -> bytes | None:
    """`curve_figure` as PNG bytes; None when there is nothing to draw."""
    figure = curve_figure(metrics, algorithm)
    if figure is None:
        return None
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _rgb(color: tuple[int, int, int]) -> tuple[float, float, float]:
    return tuple(channel / 255 for channel in color)


def load_in_background() -> None:
    """Import matplotlib and draw a throwaway curve in a daemon thread (once per process), so that the curve drawn
    after the job costs only its own drawing: a process's first drawing also loads the font and fills matplotlib's
    text caches (about a third more than a later one). Imports take Python's import lock, so drawing meanwhile just
    waits for it."""
    global _loading
    with _loading_lock:
        if _loading is None:
            _loading = threading.Thread(target=_load, name="loraflow-curve-imports", daemon=True)
            _loading.start()


def _load() -> None:
    for name in _MATPLOTLIB:
        importlib.import_module(name)
    curve_png(TrainMetrics(steps=2, losses=[(1, 2.0), (2, 1.0)], eval_loss=[(0, 2.2), (2, 1.3)], first_loss=2.0,
                           final_loss=1.0, tokens=0, wall_seconds=1, device="cpu"), "sft")


def draw_meanwhile(metrics: TrainMetrics, algorithm: str) -> None:
    """Draw the curve of a job that has ended (`curve_png`) in a daemon thread, in place of any curve drawn before;
    `drawn_curve` of the same metrics and algorithm takes it. Drawing is 50-100 ms of CPU that would otherwise follow
    the collect; started once the endpoint is deleted, it never slows the delete."""
    global _drawing
    future: Future[bytes | None] = Future()

    def draw() -> None:
        try:
            future.set_result(curve_png(metrics, algorithm))
        except BaseException as e:  # noqa: BLE001 - `drawn_curve` draws again, and raises there
            future.set_exception(e)

    with _loading_lock:
        _drawing = (_curve_key(metrics, algorithm), future)
    threading.Thread(target=draw, name="loraflow-curve", daemon=True).start()


def drawn_curve(metrics: TrainMetrics, algorithm: str) -> bytes | None:
    """`curve_png(metrics, algorithm)`: the one `draw_meanwhile` drew of the same, else drawn now."""
    global _drawing
    with _loading_lock:
        drawing, _drawing = _drawing, None
    if drawing is not None and drawing[0] == _curve_key(metrics, algorithm):
        try:
            return drawing[1].result()
        except Exception:  # noqa: BLE001 - drawn again below, where its error is the report's
            pass
    return curve_png(metrics, algorithm)


def _curve_key(metrics: TrainMetrics, algorithm: str) -> str:
    return f"{algorithm}\0{metrics.model_dump_json()}"
