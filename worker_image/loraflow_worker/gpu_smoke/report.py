"""The GPU smoke's report: one table of the runs and why `all` engaged what it did."""

from __future__ import annotations


def report(results: list[dict]) -> str:
    """A table of the runs: timed steps, tokens/s, how much faster `all` is than each run of the same algorithm
    (the speed-up of what the variant removes, or the cost of what it forces on), the peak memory torch reserved
    and the device's own peak, the completions vLLM generated, and what engaged; then the reasons behind `all`'s
    plan, per algorithm, and what did not run."""
    best = {r["algorithm"]: r["tokens_per_second"] for r in results if r["variant"] == "all" and r.get("tokens_per_second")}
    lines = [f"{'variant':<24}{'algorithm':<10}{'steps':>6}{'tokens/s':>12}{'all/this':>9}{'reserved':>9}{'device':>8}"
             f"{'vLLM':>7}  engaged"]
    for r in results:
        head = f"{r['variant']:<24}{r['algorithm']:<10}"
        if r.get("skipped"):
            lines.append(f"{head}{'skipped':>27}  {r['skipped']}")
            continue
        if r.get("not_run"):
            lines.append(f"{head}{'not run':>27}  {r['not_run']}")
            continue
        if r.get("error"):
            lines.append(f"{head}{'failed':>27}  {r['error']}")
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
    skipped = [r for r in results if r.get("skipped")]
    if skipped:
        lines.append(f"{len(skipped)} run(s) skipped, not passed: " + "; ".join(
            f"{r['variant']}/{r['algorithm']} ({r['skipped']})" for r in skipped))
    not_run = sum(1 for r in results if r.get("not_run"))
    if not_run:
        lines.append(f"{not_run} run(s) not run: the deadline was reached first")
    return "\n".join(lines)


def _gib(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"
