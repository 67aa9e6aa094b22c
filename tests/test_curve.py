"""The summary's training curve (`tasks/reports/curve.py`): what is handed to matplotlib (series, axis labels, legend) and
that the PNG it writes decodes to an image of the figure's size."""

import io

from loraflow_worker.contract import TrainMetrics
from matplotlib.colors import to_rgb
from PIL import Image

from tasks.reports import curve
from tasks.reports.curve import (
    DPI,
    EVAL_COLOR,
    SIZE_INCHES,
    TRAIN_COLOR,
    curve_figure,
    curve_png,
    draw_meanwhile,
    drawn_curve,
)

SFT = TrainMetrics(steps=4, losses=[(1, 6.4), (2, 3.0), (3, 2.0), (4, 1.25)],
                   eval_loss=[(0, 6.9), (2, 3.4), (4, 2.05)], first_loss=6.4, final_loss=1.25, tokens=1234,
                   wall_seconds=2.5, device="cpu")
GRPO = SFT.model_copy(update={"eval_loss": [], "rewards": [(1, 0.1), (2, 0.4), (3, 0.9)],
                              "eval_reward": [(0, 0.05), (3, 0.7)]})


def _lines(figure):
    [axes] = figure.axes
    return axes, {line.get_label(): line for line in axes.get_lines()}


def test_sft_draws_the_training_and_eval_loss_by_step_with_labelled_axes_and_a_legend():
    axes, lines = _lines(curve_figure(SFT, "sft"))
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("step", "loss")
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["training loss", "eval loss (held-out)"]
    train, held_out = lines["training loss"], lines["eval loss (held-out)"]
    assert (list(train.get_xdata()), list(train.get_ydata())) == ([1, 2, 3, 4], [6.4, 3.0, 2.0, 1.25])
    assert (list(held_out.get_xdata()), list(held_out.get_ydata())) == ([0, 2, 4], [6.9, 3.4, 2.05])
    assert to_rgb(train.get_color()) == tuple(c / 255 for c in TRAIN_COLOR)
    assert to_rgb(held_out.get_color()) == tuple(c / 255 for c in EVAL_COLOR)


def test_grpo_draws_the_mean_reward_and_the_eval_reward():
    axes, lines = _lines(curve_figure(GRPO, "grpo"))
    assert axes.get_ylabel() == "mean reward"
    assert set(lines) == {"training mean reward", "eval mean reward (held-out)"}
    assert list(lines["eval mean reward (held-out)"].get_ydata()) == [0.05, 0.7]


def test_a_run_without_evaluation_draws_the_training_series_alone():
    axes, lines = _lines(curve_figure(SFT.model_copy(update={"eval_loss": []}), "sft"))
    assert list(lines) == ["training loss"]
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["training loss"]


def test_a_single_logged_step_draws_no_curve():
    assert curve_png(SFT.model_copy(update={"losses": [(1, 2.0)], "eval_loss": []}), "sft") is None


def test_the_png_decodes_to_an_image_of_the_figures_size():
    image = Image.open(io.BytesIO(curve_png(SFT, "sft")))
    assert image.format == "PNG"
    assert image.size == (round(SIZE_INCHES[0] * DPI), round(SIZE_INCHES[1] * DPI))
    colors = {color[:3] for _, color in image.convert("RGBA").getcolors(maxcolors=1 << 20)}
    assert TRAIN_COLOR in colors and EVAL_COLOR in colors


def test_dpo_draws_the_reward_accuracy_of_the_training_and_the_held_out_pairs():
    dpo = SFT.model_copy(update={"eval_loss": [], "reward_accuracies": [(1, 0.25), (2, 0.75), (4, 1.0)],
                                 "eval_reward_accuracies": [(0, 0.0), (4, 1.0)]})
    axes, lines = _lines(curve_figure(dpo, "dpo"))
    assert axes.get_ylabel() == "reward accuracy"
    assert list(lines["training reward accuracy"].get_ydata()) == [0.25, 0.75, 1.0]
    assert list(lines["eval reward accuracy (held-out)"].get_ydata()) == [0.0, 1.0]


def test_the_curve_drawn_meanwhile_is_the_one_the_report_takes():
    draw_meanwhile(SFT, "sft")
    _, future = curve._drawing
    assert drawn_curve(SFT, "sft") == curve_png(SFT, "sft")
    assert future.done() and curve._drawing is None  # taken, not drawn twice, and not kept


def test_a_curve_drawn_meanwhile_of_other_metrics_is_not_taken_for_the_report():
    draw_meanwhile(SFT, "sft")
    assert drawn_curve(GRPO, "grpo") == curve_png(GRPO, "grpo")
    assert drawn_curve(SFT, "sft") == curve_png(SFT, "sft")  # drawn now: the other was given up
