"""The GPU smoke's report: one table of the runs and why `all` engaged what it did, and one of the memory plan's
estimate of each run beside the peaks it measured."""

from __future__ import annotations


VARIANT_WIDTH = 27
"""Characters of the variant column: the longest name (`no-checkpointing-no-liger`) and a space."""


def report(results: list[dict]) -> str:
    """A table of the runs: timed steps, tokens/s, how much faster `all` is than each run of the same algorithm
    (the speed-up of what the variant removes, or the cost of what it forces on), the peak memory torch reserved
    and the device's own peak, the completions vLLM generated, and what engaged; then the reasons behind `all`'s
    plan, per algorithm, what the check variants found, the memory plan against the peaks (`memory_table`), and what
    did not run."""
    best = {r["algorithm"]: r["tokens_per_second"] for r in results if r["variant"] == "all" and r.get("tokens_per_second")}
    lines = [f"{'variant':<{VARIANT_WIDTH}}{'algorithm':<10}{'steps':>6}{'tokens/s':>12}{'all/this':>9}{'reserved':>9}{'device':>8}"
             f"{'vLLM':>7}  engaged"]
    for r in results:
        head = f"{r['variant']:<{VARIANT_WIDTH}}{r['algorithm']:<10}"
        if r.get("skipped"):
            lines.append(f"{head}{'skipped':>27}  {r['skipped']}")
            continue
        if r.get("not_run"):
            lines.append(f"{head}{'not run':>27}  {r['not_run']}")
            continue
        if r.get("error"):
            lines.append(f"{head}{'failed':>27}  {r['error']}")
            continue
        if r["algorithm"] == "probe":
            lines.append(f"{head}{'probed':>27}  in {r['took_s']:.0f} s: what it found is below")
            continue
        ratio = f"{best[r['algorithm']] / r['tokens_per_second']:.2f}" if best.get(r["algorithm"]) and r["tokens_per_second"] else "-"
        reserved = _gib(r.get("max_memory_reserved_gib"))
        device = _gib(r.get("device_peak_gib"))
        vllm = str(r["vllm_completions"]) if r["algorithm"] == "grpo" else "-"
        engaged = ", ".join(name for name, (on, _) in r["fast_paths"].items() if on) or "none"
        lines.append(f"{head}{r['timed_steps']:>6}{r['tokens_per_second']:>12.0f}{ratio:>9}{reserved:>9}{device:>8}"
                     f"{vllm:>7}  {engaged}")
    lines.append("reserved: torch.cuda.max_memory_reserved(), GiB; device: the device's peak used memory less its use "
                 "before the run started (NVML, sampled every 50 ms), GiB")
    for r in results:
        if r["variant"] == "all" and not r.get("error") and not r.get("not_run") and not r.get("skipped"):
            lines.append(f"why (variant `all`, {r['algorithm']}):")
            lines.extend(f"  {name}: {'on' if on else 'off'} - {reason}" for name, (on, reason) in r["fast_paths"].items())
            if r.get("fla_backends"):
                lines.append("  fla backends: " + ", ".join(f"{op} {backend}" for op, backend in sorted(r["fla_backends"].items())))
            if r.get("allocator_probe"):
                lines.append(f"  allocator settings: {r['allocator_probe']}")
    for r in results:
        if r.get("check") and not r.get("error"):
            lines.append(f"check ({r['variant']}/{r['algorithm']}): {r['check']}")
    lines.extend(memory_table(results))
    skipped = [r for r in results if r.get("skipped")]
    if skipped:
        lines.append(f"{len(skipped)} run(s) skipped, not passed: " + "; ".join(
            f"{r['variant']}/{r['algorithm']} ({r['skipped']})" for r in skipped))
    not_run = sum(1 for r in results if r.get("not_run"))
    if not_run:
        lines.append(f"{not_run} run(s) not run: the deadline was reached first")
    return "\n".join(lines)


def memory_table(results: list[dict]) -> list[str]:
    """Each run that trained, by its configuration (gradient checkpointing, Liger, a 4-bit base, as engaged), with the
    worker's memory plan of that configuration beside torch's allocated and reserved peaks and NVML's device peak, and
    the allocated peak over the estimate: the figures that calibrate the planner."""
    lines = ["memory, GiB: the plan's estimate of what ran beside the peaks measured",
             f"{'variant':<{VARIANT_WIDTH}}{'algorithm':<10}{'ckpt':>5}{'liger':>6}{'4bit':>5}{'plan':>8}"
             f"{'allocated':>10}{'reserved':>9}{'device':>8}{'alloc/plan':>11}"]
    for r in results:
        if r.get("skipped") or r.get("not_run") or r.get("error") or r["algorithm"] == "probe":
            continue
        engaged = {name: on for name, (on, _) in r["fast_paths"].items()}
        switches = "".join(f"{'on' if on else 'off':>{width}}" for on, width in (
            (engaged.get("gradient_checkpointing", False), 5), (engaged.get("liger_kernel", False), 6),
            (r.get("quantization") == "4bit", 5)))
        plan, allocated = r.get("plan_estimate_gib"), r.get("max_memory_allocated_gib")
        ratio = f"{allocated / plan:.2f}" if plan and allocated is not None else "-"
        lines.append(f"{r['variant']:<{VARIANT_WIDTH}}{r['algorithm']:<10}{switches}{_gib(plan, 2):>8}"
                     f"{_gib(allocated, 2):>10}{_gib(r.get('max_memory_reserved_gib'), 2):>9}"
                     f"{_gib(r.get('device_peak_gib'), 2):>8}{ratio:>11}")
    lines.append("plan: the worker's memory plan of the configuration that ran (its manifest's `memory_plan`, which leaves "
                 "out CUDA's own memory and the headroom); allocated, reserved: torch.cuda.max_memory_allocated(), "
                 "max_memory_reserved(); device: NVML's peak used memory less its use before the run (pynvml, from "
                 "nvidia-ml-py in the worker's lock), CUDA context included; -: not measured (no CUDA: no plan either)")
    return lines


def _gib(value: float | None, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"
