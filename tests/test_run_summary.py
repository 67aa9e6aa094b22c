"""What a run shows at a glance: its name and tags, a progress line, and a summary with its training
curve, a PNG drawn without matplotlib (decoded back here to check what it shows)."""

import base64
import re
import struct
import zlib

import pytest
from loraflow_worker.contract import TrainMetrics

from tasks.curve_png import BACKGROUND, LINE, line_chart_png
from tasks.reports import (
    RunReport,
    curve_png,
    finished_description,
    progress_description,
    run_tags,
    run_title,
    summary_markdown,
)

METRICS = TrainMetrics(steps=4, losses=[(1, 6.4), (2, 3.0), (3, 2.0), (4, 1.25)], first_loss=6.4, final_loss=1.25,
                       tokens=1234, wall_seconds=2.5, device="cpu")


def decode_png(data: bytes) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """Width, height and RGB rows of an 8-bit RGB PNG whose scanlines use filter 0."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, chunks = 8, {}
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        offset += 12 + length
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(width)])
    return width, height, rows


def line_rows(rows, x: int) -> list[int]:
    return [y for y, row in enumerate(rows) if row[x] == LINE]


def test_the_chart_is_a_valid_png_of_the_asked_size():
    width, height, rows = decode_png(line_chart_png([(1, 1.0), (2, 2.0)], width=120, height=60))
    assert (width, height) == (120, 60)
    assert rows[0][0] == BACKGROUND


def test_a_falling_loss_is_drawn_from_top_left_to_bottom_right():
    width, height, rows = decode_png(line_chart_png([(1, 6.4), (2, 3.0), (3, 2.0), (4, 1.25)], width=200, height=100))
    left, right = line_rows(rows, 8), line_rows(rows, width - 9)
    assert left and right
    assert max(left) < height / 4 and min(right) > 3 * height / 4


def test_every_column_between_the_first_and_last_point_has_the_line():
    width, _, rows = decode_png(line_chart_png([(0, 0.0), (10, 5.0), (20, 1.0)], width=160, height=80))
    assert all(line_rows(rows, x) for x in range(8, width - 8))


def test_a_flat_curve_is_drawn_across_the_middle():
    _, height, rows = decode_png(line_chart_png([(1, 0.5), (2, 0.5), (3, 0.5)], width=100, height=60))
    assert abs(line_rows(rows, 50)[0] - height / 2) <= 2


def test_no_points_is_refused():
    with pytest.raises(ValueError, match="no points"):
        line_chart_png([])


def test_sft_plots_the_loss_and_grpo_the_mean_reward():
    grpo = METRICS.model_copy(update={"rewards": [(1, 0.1), (2, 0.9)]})
    _, height, sft_rows = decode_png(curve_png(METRICS, "sft"))
    _, _, grpo_rows = decode_png(curve_png(grpo, "grpo"))
    assert min(line_rows(sft_rows, 10)) < height / 4  # the loss starts high
    assert max(line_rows(grpo_rows, 10)) > 3 * height / 4  # the reward starts low


def test_a_single_logged_step_draws_no_curve():
    assert curve_png(METRICS.model_copy(update={"losses": [(1, 2.0)]}), "sft") is None


def test_the_run_name_reads_name_model_algorithm_gpu():
    assert run_title("capybara", "Qwen/Qwen3-0.6B", "sft", "RTX 4090") == "capybara-qwen3-0.6b-sft-rtx-4090"
    assert run_title("local", "/tmp/models/tiny-model/", "grpo", "A100 SXM") == "local-tiny-model-grpo-a100-sxm"


def test_the_run_tags_name_algorithm_model_and_every_gpu():
    assert run_tags("Qwen/Qwen3-0.6B", "sft", ["RTX 4090", "H100"]) == [
        "algorithm:sft", "model:Qwen3-0.6B", "gpu:RTX 4090", "gpu:H100"]


def test_the_progress_line_shows_step_loss_throughput_and_eta():
    line = progress_description({"kind": "progress", "stage": "training", "step": 12, "total_steps": 40,
                                 "loss": 1.23456, "tokens_per_second": 8312.4, "eta_seconds": 130.0, "message": ""})
    assert line == "training: step 12/40 · loss 1.2346 · 8,312 tokens/s · ETA 2m 10s"


def test_a_grpo_progress_line_shows_the_mean_reward_beside_the_loss():
    line = progress_description({"stage": "training", "step": 3, "total_steps": 10, "loss": 0.01, "reward": 0.8125})
    assert line == "training: step 3/10 · loss 0.0100 · reward 0.812"


def test_the_progress_line_leaves_out_what_is_not_known_yet():
    assert progress_description({"stage": "loading", "step": 0, "message": "downloading the model"}) == \
        "loading: step 0/? · downloading the model"


def test_the_summary_embeds_the_curve_and_links_the_adapter_the_store_and_the_run():
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, billed_usd=0.0007, adapter_url="file:///s/runs/r1/adapter",
                       store_url="file:///s", run_url="file:///s/runs/r1", curve_url="file:///s/runs/r1/curve.png")
    png = curve_png(METRICS, "sft")
    text = summary_markdown(report, png)
    [embedded] = re.findall(r"!\[training loss by step\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", text)
    assert base64.b64decode(embedded) == png
    for expected in ("| Cost before (worst case) | $0.35", "| Estimated cost | $0.0005", "| Billed by RunPod | $0.0007",
                     "[file:///s/runs/r1/adapter](file:///s/runs/r1/adapter)", "[file:///s](file:///s)",
                     "[file:///s/runs/r1](file:///s/runs/r1)", "[curve.png](file:///s/runs/r1/curve.png)"):
        assert expected in text, expected


def test_a_completed_jobs_progress_line_comes_from_its_result():
    output = {"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1", "adapter_path": "runs/r1/adapter",
              "metrics": METRICS.model_dump(mode="json")}
    assert finished_description(output) == "completed: step 4/4 · loss 1.2500 · 494 tokens/s · ETA 0s"
